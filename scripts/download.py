# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Download a Hugging Face model repo into checkpoints/ORG/NAME/hf (weights, config, tokenizer)."""
import argparse
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_output_dir, error_boundary  # noqa: E402

PATTERNS = ["*.json", "*.model", "*.tiktoken", "original/tokenizer.model"]
PROBE_TIMEOUT_S = 5


def check_hub(repo_id: str):
    """A ConnectionError now when the hub cannot answer, rather than huggingface_hub's retries
    (tens of seconds) and its traceback."""
    from huggingface_hub import constants
    if constants.HF_HUB_OFFLINE:
        raise ConnectionError("HF_HUB_OFFLINE is set, and downloading needs the Hugging Face hub; unset it, or "
                              "prepare the default model offline with ./scripts/prepare.sh")
    url = f"{constants.ENDPOINT.rstrip('/')}/api/models/{repo_id}"
    try:
        urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S)
    except urllib.error.HTTPError:
        pass  # the hub answered (gated, private, missing): the download says what is wrong
    except (OSError, ValueError) as e:  # ValueError: an HF_ENDPOINT that is not a URL
        reason = getattr(e, "reason", e)
        raise ConnectionError(f"the Hugging Face hub ({constants.ENDPOINT}) is unreachable ({reason}); check the "
                              "network, HF_ENDPOINT or a proxy, or prepare the default model offline with "
                              "./scripts/prepare.sh") from None


def weights_to_fetch(files: list) -> list:
    """The repo's weights: its top-level safetensors, else its top-level pytorch_model*.bin. (Copies in
    other formats sit in folders: gpt-oss's original/ and metal/, Meta's original/; a pattern such as
    *.safetensors would match those too.)"""
    top = [f for f in files if "/" not in f]
    return [f for f in top if f.endswith(".safetensors")] or [f for f in top if f.startswith("pytorch_model")
                                                               and f.endswith(".bin")]


def download(repo_id: str, checkpoints: Path = Path("checkpoints"), token: str = None) -> Path:
    from huggingface_hub import HfApi, snapshot_download
    from huggingface_hub.errors import GatedRepoError, HfHubHTTPError, RepositoryNotFoundError

    if repo_id.count("/") != 1 or not all(repo_id.split("/")):
        raise ValueError(f"--repo_id {repo_id!r} is not ORG/NAME (e.g. HuggingFaceTB/SmolLM2-135M-Instruct)")
    token = token or os.environ.get("HF_TOKEN")
    target = check_output_dir(checkpoints / repo_id / "hf", "--checkpoints")
    check_hub(repo_id)
    try:
        files = HfApi().list_repo_files(repo_id, token=token)
        snapshot_download(repo_id, local_dir=target, allow_patterns=PATTERNS + weights_to_fetch(files), token=token)
    except GatedRepoError:
        raise ValueError(f"{repo_id} is gated: accept its license on huggingface.co, then set HF_TOKEN "
                         "(or pass --hf_token)") from None
    except RepositoryNotFoundError:
        raise ValueError(f"{repo_id} not found on the hub (or it is private: set HF_TOKEN)") from None
    except HfHubHTTPError as e:
        raise ConnectionError(f"the hub refused the download of {repo_id} ({' '.join(str(e).split())})") from None
    print(f"downloaded {repo_id} to {target}", file=sys.stderr)
    return target


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--repo_id", required=True, help="e.g. meta-llama/Llama-3.1-8B-Instruct")
    p.add_argument("--checkpoints", type=Path, default=Path("checkpoints"), help="root folder for checkpoints")
    p.add_argument("--hf_token", default=None, help="hub token for gated repos (default: $HF_TOKEN)")
    args = p.parse_args(argv)
    with error_boundary():
        download(args.repo_id, args.checkpoints, args.hf_token)


if __name__ == "__main__":
    main()
