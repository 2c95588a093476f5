"""Crash safety: SIGKILL a training process at many moments during saves (PCcheck §4.1), and a\nprocess deleting a checkpoint at many moments during the deletion."""

from __future__ import annotations

import json
import multiprocessing
import os
import random
import shutil
import signal
import time
from pathlib import Path

import _loop
import pytest
import torch
from _dist import process

import gockpt
from gockpt.load import read_checkpoint
from gockpt.persist import persist
from gockpt.storage import cleanup_staging, is_complete, remove_checkpoint

HERE = Path(__file__).parent


def _kill_after(root: Path, mode: str, durable_lines: int, jitter_s: float) -> None:
    """Run :func:`_loop.crash_child` in a child process; SIGKILL it ``jitter_s`` after its
    ``durable_lines``-th checkpoint is durable."""
    recv, send = multiprocessing.Pipe(duplex=False)
    proc = process(_loop.crash_child, args=(str(root), mode, send.send))
    proc.start()
    send.close()
    try:
        seen = 0
        deadline = time.monotonic() + 60
        while seen < durable_lines and time.monotonic() < deadline:
            assert recv.poll(max(0.0, deadline - time.monotonic())), "no checkpoint was durable in 60 s"
            try:
                recv.recv()
            except EOFError:
                proc.join(5)
                pytest.fail(f"training process ended early (exit code {proc.exitcode})")
            seen += 1
        # The kill moment: a random point in the save stream (not a race we wait out).
        time.sleep(jitter_s)
    finally:
        proc.kill()
        proc.join()
        recv.close()


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


def _delete_in_a_child(path: str, delay_s: float | None) -> float:
    """Fork a child that deletes ``path``; SIGKILL it ``delay_s`` after it starts, or (None) let
    it finish. Returns the seconds from its start to its end (a child of a large process also
    pays copy-on-write faults that an in-process deletion does not: the test below draws its
    kill delays against this)."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: only storage calls, then _exit (no pytest teardown in the child)
        try:
            os.close(r)
            os.write(w, b"go")
            remove_checkpoint(path)
        finally:
            os._exit(0)
    os.close(w)
    try:
        assert os.read(r, 2) == b"go"
        t0 = time.perf_counter()
        if delay_s is not None:
            time.sleep(delay_s)
            os.kill(pid, signal.SIGKILL)
    finally:
        os.waitpid(pid, 0)
        os.close(r)
    return time.perf_counter() - t0


def test_sigkill_during_deletion_never_leaves_a_torn_checkpoint(tmp_path, make_request):
    # Many small shards: deleting them takes long enough to be killed in the middle of it.
    tensors = {f"t{i:03d}": torch.full((16,), float(i)) for i in range(600)}
    template = tmp_path / "template"
    persist(make_request(str(template / "old"), tensors, step=1, max_shard_bytes=64))
    persist(make_request(str(template / "new"), tensors, step=2, max_shard_bytes=64))
    assert len(os.listdir(template / "new")) == 602
    probe = tmp_path / "probe"
    shutil.copytree(template, probe, copy_function=os.link)
    duration = _delete_in_a_child(str(probe / "new"), None)
    assert not (probe / "new").exists()

    rng = random.Random(20240610)
    # Kill delays are drawn between the latest that came too early (the directory intact) and
    # the earliest that came too late (deleted): a bisection that closes on the deletion
    # whatever this machine's speed, rather than a fixed range that a loaded machine's start-up
    # jitter can straddle without ever landing inside the deletion.
    lo, hi = 0.0, 1.5 * duration
    outcomes = {"intact": 0, "interrupted": 0, "deleted": 0}
    for trial in range(60):
        if trial >= 24 and outcomes["interrupted"]:
            break
        root = tmp_path / f"trial{trial}"
        shutil.copytree(template, root, copy_function=os.link)  # hard links: fast, same bytes
        delay = rng.uniform(lo, hi)
        _delete_in_a_child(str(root / "new"), delay)

        scratch = [n for n in os.listdir(root) if n.startswith(".")]
        outcome = "interrupted" if scratch else "intact" if (root / "new").exists() else "deleted"
        outcomes[outcome] += 1
        if outcome == "deleted":
            hi = delay
        elif outcome == "intact":
            lo = delay
        if hi - lo < 0.05 * duration:  # jitter closed (or crossed) the range: open it again
            lo, hi = max(0.0, min(lo, hi) - 0.25 * duration), max(lo, hi) + 0.25 * duration
        # Torn = a visible directory with a manifest (or one is_complete accepts) missing a
        # file it names; 'latest' never names one.
        for entry in os.listdir(root):
            path = root / entry
            if entry.startswith(".") or not path.is_dir():
                continue
            if is_complete(str(path)) or (path / "manifest.json").exists():
                files = json.loads((path / "manifest.json").read_text())["files"]
                missing = [n for n in files if not (path / n).is_file()]
                assert not missing, f"trial {trial}: {entry} is torn ({len(missing)} missing)"
        latest = gockpt.latest_checkpoint(str(root))
        assert latest in (str(root / "new"), str(root / "old")), f"trial {trial}: latest {latest}"
        read_checkpoint(latest)
        # The dead deleter's scratch is provably stale: the next writer removes it.
        cleanup_staging(str(root))
        assert [n for n in os.listdir(root) if n.startswith(".")] == []
    assert outcomes["interrupted"] >= 1, f"no kill landed mid-deletion: {outcomes}"
