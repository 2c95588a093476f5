"""Crash safety: SIGKILL a training process at many moments during saves (PCcheck §4.1)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import gockpt
from gockpt.storage import is_complete

HERE = Path(__file__).parent


def _kill_after(root: Path, mode: str, durable_lines: int, jitter_s: float) -> None:
    proc = subprocess.Popen(
        [sys.executable, str(HERE / "_loop.py"), str(root), mode],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1",
             "PYTHONPATH": os.pathsep.join([str(HERE.parent), os.environ.get("PYTHONPATH", "")])},
    )
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < durable_lines and time.monotonic() < deadline:
            line = proc.stdout.readline()
            assert line, "training process ended early"
            seen += line.startswith("durable")
        # The kill moment: a random point in the save stream (not a race we wait out).
        time.sleep(jitter_s)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["gockpt_o", "async"])
def test_sigkill_never_leaves_latest_incomplete(tmp_path, mode):
    rng = random.Random(1234)
    last_step = -1
    for round_ in range(5):
        _kill_after(tmp_path, mode, durable_lines=1 + round_ % 3, jitter_s=rng.uniform(0, 0.05))
        latest = gockpt.latest_checkpoint(str(tmp_path))
        assert latest is not None, f"round {round_}: no complete checkpoint named by latest"
        state = gockpt.load_checkpoint(latest)  # verifies sizes and checksums
        assert state.captured_step >= 1
        # Every visible checkpoint with a manifest verifies; nothing partial looks complete.
        for d in tmp_path.iterdir():
            if d.name.startswith("ckpt-") and is_complete(str(d)):
                gockpt.load_checkpoint(str(d))
            elif d.name.startswith("ckpt-"):
                pytest.fail(f"round {round_}: {d.name} is visible without a manifest")
        last_step = max(last_step, state.captured_step)
