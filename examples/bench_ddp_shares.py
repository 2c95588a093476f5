"""Persist time per checkpoint under DDP: one writer vs the ranks sharing the write (issue 13).

Runs N processes (default 2) over gloo on the CPU, training a DDP model with AdamW. Checkpoints
alternate, side by side in one run, between

- ``1 writer``: a :class:`gockpt.Engine` on rank 0 writes the whole replicated state (what a
  replicated run did before: rank 0 copies and writes everything);
- ``N sharing writers``: a :class:`gockpt.sharded.ShardedEngine` with ``replicated=True``: each
  rank writes its own share (about 1/N of the state), rank 0 commits.

Each checkpoint is waited for before the next, so the writes never overlap. Printed: medians
over the checkpoints of the persist time (seconds to write and fsync the files; for the shared
write, the slowest rank's part) and of the time from the request to the durable (committed)
checkpoint. Usage::

    python examples/bench_ddp_shares.py --state-mib 96 --checkpoints 5
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import tempfile
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gockpt
from gockpt.sharded import ShardedEngine


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    width = 512
    # AdamW keeps 3 tensors per parameter: the state is about 3x the parameters.
    layers = max(1, int(args.state_mib * 2**20 / 3 / (4 * width * width)))
    torch.manual_seed(0)
    ddp = DDP(nn.Sequential(*[nn.Linear(width, width) for _ in range(layers)]))
    opt = torch.optim.AdamW(ddp.parameters(), lr=1e-4)
    cfg = gockpt.GoCkptConfig(mode="lazy", max_inflight=1)

    def step(i: int) -> None:
        g = torch.Generator().manual_seed(1000 * i + rank)
        ddp(torch.randn(4, width, generator=g)).square().mean().backward()
        opt.step()
        opt.zero_grad()

    step(0)
    if rank == 0:  # one directory per setup: each has its own writer claim
        os.makedirs(f"{root}/one"), os.makedirs(f"{root}/shared")
    dist.barrier()
    single = gockpt.Engine(ddp.module, opt, cfg) if rank == 0 else None
    shared = ShardedEngine(ddp, opt, cfg, replicated=True, commit_timeout_s=600)
    one: list[tuple[float, float]] = []
    many: list[tuple[float, float]] = []
    i = 1
    for c in range(args.checkpoints + 1):  # the first round warms up (page cache, threads)
        step(i)
        i += 1
        if single is not None:
            h = single.save(f"{root}/one/{c}")
            step(i)  # lazy: the copy window is the next step's forward/backward
            m = h.result()
            if c:
                one.append((m.persist_s, m.time_to_durable_s))
                one_bytes = (m.state_bytes, m.host_bytes)
        else:
            step(i)
        i += 1
        dist.barrier()
        sh = shared.save(f"{root}/shared/{c}")
        step(i)
        i += 1
        shared.wait()
        part = sh.part.metrics
        views: list = [None] * world
        dist.all_gather_object(views, (part.persist_s, part.time_to_durable_s, part.persist_bytes,
                                       part.state_bytes, part.host_bytes))
        if c and rank == 0:
            many.append((max(v[0] for v in views), max(v[1] for v in views)))
            shares = views
    if single is not None:
        single.close()
    shared.close()
    if rank == 0:
        state = sum(t.numel() * t.element_size() for t in ddp.module.state_dict().values())
        state += sum(t.numel() * t.element_size() for st in opt.state.values()
                     for t in st.values() if isinstance(t, torch.Tensor))
        med = lambda xs, j: statistics.median(x[j] for x in xs)  # noqa: E731
        print(f"DDP on CPU over gloo, {world} processes, AdamW, {state / 2**20:.1f} MiB of state, "
              f"mode lazy, medians over {args.checkpoints} checkpoints (files fsynced to {root})")
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"  1 writer: rank 0 copies {mib(one_bytes[0])} to a {mib(one_bytes[1])} host slot; "
              f"sharing: per rank {[mib(v[3]) for v in shares]} copied, "
              f"{[mib(v[4]) for v in shares]} host slots, {[mib(v[2]) for v in shares]} written")
        print(f"  {'setup':<22} {'persist_s':>10} {'request->durable_s':>19}")
        print(f"  {'1 writer':<22} {med(one, 0):>10.3f} {med(one, 1):>19.3f}")
        print(f"  {f'{world} sharing writers':<22} {med(many, 0):>10.3f} {med(many, 1):>19.3f}")
        print(f"  persist time ratio (sharing / 1 writer): {med(many, 0) / med(one, 0):.2f} "
              f"(ideal {1 / world:.2f}; the {world} processes share this machine's CPUs and disk)")
    # End without tearing the gloo group down from Python: on torch 2.x destroying it while the
    # DDP reducer still holds work of the other rank can hang or abort at random.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes (ranks)")
    ap.add_argument("--state-mib", type=float, default=96.0, help="model + AdamW state, MiB")
    ap.add_argument("--checkpoints", type=int, default=5, help="measured checkpoints per setup")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    args = ap.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        mp.spawn(_worker, args=(args.world, port, args, root), nprocs=args.world)


if __name__ == "__main__":
    main()
