"""One rank of tests/test_sharded_crash.py: FSDP2 training with sharded saves; rank 1 is
killed (SIGKILL) right after requesting the second checkpoint, while its part is in flight.

    python _sharded_crash_child.py RANK WORLD PORT ROOT
Rank 0 writes ROOT/rank0.txt: "raised <error>" when its wait() raised, "returned" otherwise.
"""

from __future__ import annotations

import os
import signal
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn

import gockpt
from gockpt.sharded import ShardedEngine


def model() -> nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    # fully_shard's default mesh is on the accelerator where one exists; these ranks run on CPU.
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    m = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 5))
    for layer in m:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(m, mesh=mesh)
    return m


def step(m: nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    g = torch.Generator().manual_seed(1000 * i + dist.get_rank())
    ((m(torch.randn(8, 16, generator=g)) - torch.randn(8, 5, generator=g)) ** 2).mean().backward()
    opt.step()
    opt.zero_grad()


def main(rank: int, world: int, port: int, root: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=20))
    m = model()
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    cfg = gockpt.GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3)
    eng = ShardedEngine(m, opt, cfg, commit_timeout_s=10)
    for i in range(3):
        step(m, opt, i)
        eng.step_end()
    eng.save(f"{root}/ck-1", state_fn=lambda: {"version": eng.version})
    eng.wait()  # ck-1 committed on every rank
    step(m, opt, 3)
    eng.step_end()
    eng.save(f"{root}/ck-2", state_fn=lambda: {"version": eng.version})  # K = 3: in flight
    if rank == 1:
        os.kill(os.getpid(), signal.SIGKILL)
    outcome = "returned"
    try:
        for i in range(4, 8):
            step(m, opt, i)
            eng.step_end()
        eng.wait()
    except BaseException as e:  # noqa: BLE001 - the outcome is the test's to judge
        outcome = f"raised {type(e).__name__}: {e}"
    with open(f"{root}/rank0.txt", "w") as f:
        f.write(outcome)
    os._exit(0)  # the group is broken: no collective shutdown


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4])
