"""SIGKILL of one rank during a sharded save (issue 13): the previous checkpoint is the one
every rank resumes, and the surviving rank is told within the commit timeout."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import torch
from _dist import end_rank, spawn

import gockpt
from gockpt.dcp import load_full, load_sharded

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parent


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _resume(rank: int, world: int, port: int, root: str, out: str) -> None:
    import _sharded_crash_child as child
    import torch.distributed as dist

    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    m = child.model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    latest = gockpt.latest_checkpoint(root)
    extra = load_sharded(latest, m, opt)
    with open(f"{out}-{rank}", "w") as f:
        f.write(f"{os.path.basename(latest)} {extra['version']}")
    end_rank()


def test_sigkill_of_one_rank_during_a_save_keeps_the_previous_checkpoint(tmp_path):
    root = str(tmp_path / "ckpts")
    os.makedirs(root)
    port = _port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    procs = [subprocess.Popen([sys.executable, str(_HERE / "_sharded_crash_child.py"), str(r), "2",
                               str(port), root], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for r in range(2)]
    try:
        outs = [p.communicate(timeout=180) for p in procs]  # bounded: a hang fails here
    finally:
        for p in procs:
            p.kill()
    assert procs[1].returncode == -9
    assert procs[0].returncode == 0, outs[0][1].decode()[-3000:]
    outcome = (Path(root) / "rank0.txt").read_text()
    assert outcome.startswith("raised"), outcome  # the survivor learns the save failed
    # On disk: ck-1 complete and latest; ck-2 never became a checkpoint; no staging left over
    # once a later run cleans up (the survivor removed its own).
    assert gockpt.latest_checkpoint(root).endswith("ck-1")
    assert not os.path.exists(os.path.join(root, "ck-2"))
    full = load_full(os.path.join(root, "ck-1"))
    assert full.extra == {"version": 3}
    # Every rank of a fresh run resumes the previous checkpoint.
    out = str(tmp_path / "resumed")
    spawn(_resume, args=(2, _port(), root, out), nprocs=2)
    assert [Path(f"{out}-{r}").read_text() for r in range(2)] == ["ck-1 3", "ck-1 3"]
