# Copyright (c) brisk developers. BSD-3-Clause license (see LICENSE).
"""What a command line accepts and how it fails: argparse types with ranges, output checks, and
the error boundary every CLI runs its main() in.

Bad input is one `error: ...` line on stderr and a non-zero exit. The boundary knows which
exception classes mean bad input (a file, a config, a flag, the disk, a closed pipe); anything
else is a bug in brisk and keeps its traceback.
"""
import argparse
import contextlib
import errno
import math
import os
import sys
import time
from pathlib import Path

# ---------------------------------------------------------------------------------------------
# Flags: checked by argparse, before any work


def int_in(low: int, high: int = None):
    """A whole number in [low, high] (no upper end when high is None)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        if high is not None and value > high:
            raise argparse.ArgumentTypeError(f"must be at most {high}, got {value}")
        return value
    return parse


positive_int = int_in(1)
nonnegative_int = int_in(0)
SEED = int_in(0, 2**63 - 1)  # what torch.manual_seed accepts on every platform


def finite_float(low: float = -math.inf, high: float = math.inf, low_open: bool = False, high_open: bool = False):
    """A float in [low, high]; low_open / high_open exclude an end. nan and inf are never valid."""
    interval = f"{'(' if low_open else '['}{low:g}, {high:g}{')' if high_open else ']'}"

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"must be a finite number, got {text}")
        if value < low or value > high or (low_open and value == low) or (high_open and value == high):
            raise argparse.ArgumentTypeError(f"must lie in {interval}, got {value:g}")
        return value
    return parse


# ---------------------------------------------------------------------------------------------
# Outputs: checked before the work that produces them, so a bad path fails in a second, not after it


def check_output_file(path, flag: str) -> Path:
    """A file we will write (atomically, so an existing one is replaced whole): its folder must exist
    and be writable, and the path must not be a folder."""
    path = Path(path)
    if path.is_dir():
        raise ValueError(f"{flag} {path} is a folder; give a file name")
    folder = path.parent
    if not folder.is_dir():
        raise ValueError(f"{flag} {path}: folder {folder} does not exist; create it first")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: folder {folder} is not writable")
    return path


def check_output_dir(path, flag: str) -> Path:
    """A folder we will create if needed and write into."""
    path = Path(path)
    if path.exists() and not path.is_dir():
        raise ValueError(f"{flag} {path} is a file, not a folder; give a folder (it is created if missing)")
    existing = next(p for p in (path, *path.parents) if p.exists())
    if not existing.is_dir():
        raise ValueError(f"{flag} {path}: {existing} is a file, not a folder")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"{flag} {path}: folder {existing} is not writable")
    return path


# ---------------------------------------------------------------------------------------------
# The boundary

# Exception classes that mean bad input or a hostile environment, not a bug. ValueError is brisk's
# own "bad input" (the library raises it with a message that says what to do); the loaders turn a
# foreign library's errors on a bad file into one.
EXPECTED = (ValueError, OSError, UnicodeError, MemoryError)

OS_HINTS = {
    errno.ENOSPC: "no space left on the device; free some or write elsewhere",
    errno.EDQUOT: "disk quota exceeded; free some space or write elsewhere",
    errno.EACCES: "permission denied",
    errno.EPERM: "operation not permitted",
    errno.EROFS: "the file system is read-only; write elsewhere",
    errno.EISDIR: "is a folder, not a file",
    errno.ENOTDIR: "a part of the path is a file, not a folder",
}


def describe(e: BaseException) -> str:
    """The one-line message for an expected exception."""
    if isinstance(e, OSError) and not isinstance(e, FileNotFoundError) and e.errno in OS_HINTS:
        where = e.filename or ""
        return f"{where}{': ' if where else ''}{OS_HINTS[e.errno]} ({e.strerror})"
    if isinstance(e, MemoryError):
        return "out of memory; use a smaller model, batch or context"
    if isinstance(e, UnicodeError):
        return f"text is not valid UTF-8 ({e})"
    text = str(e) or type(e).__name__
    if isinstance(e, OSError) and e.filename and e.filename not in text:
        text = f"{e.filename}: {text}"
    return " ".join(text.split())  # one line, whatever the library put in its message


RANK0_GRACE_S = 5


def is_rank0() -> bool:
    return int(os.environ.get("RANK", "0")) == 0


def fail(message: str):
    """Exit with status 1 and `error: message` on stderr, once (rank 0 under torchrun). The message
    travels in the SystemExit, which the interpreter prints; in-process callers read it there."""
    if is_rank0():
        sys.exit(f"error: {message}")
    # torchrun stops every rank when one exits: give rank 0, which meets the same bad input, time
    # to say what it is.
    time.sleep(RANK0_GRACE_S)
    sys.exit(1)


@contextlib.contextmanager
def error_boundary():
    """Run a CLI's main() in this: expected failures become one `error:` line and exit status 1."""
    try:
        yield
    except KeyboardInterrupt:
        sys.exit(130)
    except BrokenPipeError:
        # The reader went away (`| head`): point stdout at /dev/null so the interpreter's final flush
        # does not fail a second time.
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        fail("stdout was closed before the output ended (broken pipe)")
    except EXPECTED as e:
        fail(describe(e))
    except Exception as e:
        # Out of memory is the environment, not a bug: torch says so with its own class on a GPU and
        # with a RuntimeError from its CPU allocator.
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(e, torch.OutOfMemoryError):
            fail(f"out of GPU memory ({describe(e)}); use a smaller model, batch or context")
        if isinstance(e, RuntimeError) and "DefaultCPUAllocator: can't allocate memory" in str(e):
            fail("out of memory (torch could not allocate a tensor); use a smaller model, batch or context")
        raise
