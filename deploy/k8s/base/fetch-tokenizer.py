"""Init container: download a model's tokenizer files from the Hugging Face Hub (stdlib only).

Environment: HF_MODEL (repo id, required), TOKENIZER_DIR (default /var/lib/kvlb/tokenizer),
HF_TOKEN (for gated models), HF_ENDPOINT (default https://huggingface.co), HF_REVISION (default main).
Files already present are kept, so a restart does not download again.
"""

import os
import sys
import urllib.request
from pathlib import Path

FILES = ("tokenizer.json", "tokenizer_config.json")


def main() -> int:
    model = os.environ.get("HF_MODEL", "")
    if not model:
        print("fetch-tokenizer: HF_MODEL is not set", file=sys.stderr)
        return 2
    target = Path(os.environ.get("TOKENIZER_DIR", "/var/lib/kvlb/tokenizer"))
    endpoint = os.environ.get("HF_ENDPOINT", "https://huggingface.co").rstrip("/")
    revision = os.environ.get("HF_REVISION", "main")
    token = os.environ.get("HF_TOKEN", "")
    target.mkdir(parents=True, exist_ok=True)
    for name in FILES:
        path = target / name
        if path.exists() and path.stat().st_size > 0:
            continue
        request = urllib.request.Request(f"{endpoint}/{model}/resolve/{revision}/{name}")
        if token:
            request.add_header("Authorization", f"Bearer {token}")
        with urllib.request.urlopen(request, timeout=60) as response:
            data = response.read()
        partial = path.with_suffix(".partial")
        partial.write_bytes(data)
        partial.replace(path)
        print(f"fetch-tokenizer: {model} {name}: {len(data)} bytes")
    return 0


if __name__ == "__main__":
    sys.exit(main())
