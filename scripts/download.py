# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Download a Hugging Face model repo into checkpoints/ORG/NAME/hf (weights, config, tokenizer)."""
import argparse
import os
import sys
from pathlib import Path

PATTERNS = ["*.json", "*.model", "*.tiktoken", "original/tokenizer.model"]


def download(repo_id: str, checkpoints: Path = Path("checkpoints"), token: str = None) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    token = token or os.environ.get("HF_TOKEN")
    target = checkpoints / repo_id / "hf"
    try:
        files = HfApi().list_repo_files(repo_id, token=token)
        # Prefer safetensors; fall back to .bin only for repos that have nothing else.
        weights = ["*.safetensors"] if any(f.endswith(".safetensors") for f in files) else ["pytorch_model*.bin"]
        snapshot_download(repo_id, local_dir=target, allow_patterns=PATTERNS + weights, token=token)
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated: accept its license on huggingface.co, then set HF_TOKEN "
                         "(or pass --hf_token)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} not found on the hub (or it is private: set HF_TOKEN)") from None
    print(f"downloaded {repo_id} to {target}", file=sys.stderr)
    return target


def main():
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--checkpoints", type=Path, default=Path("checkpoints"), help="root folder for checkpoints")
    p.add_argument("--hf_token", default=None, help="hub token for gated repos (default: $HF_TOKEN)")
    args = p.parse_args()
    try:
        download(args.repo_id, args.checkpoints, args.hf_token)
    except ValueError as e:
        sys.exit(f"error: {e}")


if __name__ == "__main__":
    main()
