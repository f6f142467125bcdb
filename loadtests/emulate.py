"""``kvlb emulate``: the emulator command with the balancer's tokenizers (I/O).

:mod:`replicas` tokenizes through its own seam (:mod:`replicas.sim.tokenizer`) and imports nothing from
the balancer; this module is where the two meet. :class:`BalancerTokenizers` reads ``--tokenizer`` as
the balancer does: ``default`` is the balancer's default tokenizer (DeepSeek-V3 with kvlb's chat
template), a folder or ``tokenizer.json`` path loads as a pool's ``tokenizer`` does, and ``none`` is the
balancer's token-id passthrough, so replicas and balancer compute the same ids.

:func:`register` is the ``kvlb emulate`` entry point (with the deprecated alias ``kvlb sim``); the
children of ``--processes N`` run ``python -m loadtests.emulate``.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from pathlib import Path

from balancer.tokenizer.default import deepseek_tokenizer_file, default_tokenizer
from balancer.tokenizer.tokenizer import TokenIdTokenizer, Tokenizer, load_tokenizer
from replicas.command import EmulateCommand
from replicas.sim.tokenizer import DEFAULT_TOKENIZER, NO_TOKENIZER

EMULATE_MODULE = "loadtests.emulate"
"""This module's name, run by child processes (``__name__`` is ``__main__`` there)."""


def default_tokenizer_path() -> Path | None:
    """The folder of the DeepSeek-V3 ``tokenizer.json`` (``deepseek-tokenizer`` package), if installed."""
    file = deepseek_tokenizer_file()
    return None if file is None else file.parent


class BalancerTokenizers:
    """The emulator's tokenizer loader (:class:`replicas.sim.tokenizer.TokenizerLoader`) over
    :mod:`balancer.tokenizer`."""

    __slots__ = ()

    def load(self, name: str) -> Tokenizer:
        """The tokenizer ``name``. Blocking: run it in a thread."""
        if name == NO_TOKENIZER:
            return TokenIdTokenizer()
        if name == DEFAULT_TOKENIZER:
            return default_tokenizer()
        return load_tokenizer(name)

    def model_path(self, name: str) -> str:
        """A local folder routers can load the tokenizer from (``""`` for ``none`` or when the default
        tokenizer is not installed)."""
        if name == NO_TOKENIZER:
            return ""
        if name == DEFAULT_TOKENIZER:
            folder = default_tokenizer_path()
            return "" if folder is None else str(folder)
        path = Path(name)
        return str(path if path.is_dir() else path.parent)


BALANCER_TOKENIZERS = BalancerTokenizers()

COMMAND = EmulateCommand(BALANCER_TOKENIZERS, EMULATE_MODULE)
"""``kvlb emulate`` with the balancer's tokenizers."""


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    COMMAND.register(subparsers)


def main(argv: Sequence[str] | None = None) -> int:
    return COMMAND.main(argv)


if __name__ == "__main__":
    raise SystemExit(main())
