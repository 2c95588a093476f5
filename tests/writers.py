"""Another GoCkpt writer, in a process of its own (any PID namespace would behave the same)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

_CLAIM_AND_WAIT = (
    "import sys\n"
    "from gockpt.storage import claim_directory\n"
    "claim = claim_directory(sys.argv[1])\n"
    "print('claimed', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def another_writer(directory: str | Path) -> Iterator[subprocess.Popen]:
    """A process holding the writer claim of ``directory`` until the block ends (then SIGKILL)."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(Path(__file__).resolve().parent.parent), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([sys.executable, "-c", _CLAIM_AND_WAIT, str(directory)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "claimed"
        yield proc
    finally:
        proc.kill()  # SIGKILL: no chance to release anything
        proc.wait()
