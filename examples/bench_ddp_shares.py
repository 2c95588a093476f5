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
checkpoint.

On one machine the N processes share one disk and its CPUs, so the shared write cannot show
the gain of writers that each have their own storage bandwidth (a NIC per node to an object
store, a disk per node). ``--link-mib-s B`` adds both setups again with that emulated: every
process's writes go through a link of B MiB/s of its own (``examples/throttled_fs.py``, an
fsspec filesystem under the protocol ``throttled``, given to the engines as
``storage_options``); the files still land on this machine's disk. These rows are labelled
``EMULATED``. Usage::

    python examples/bench_ddp_shares.py --state-mib 96 --checkpoints 5
    python examples/bench_ddp_shares.py --state-mib 96 --checkpoints 5 --link-mib-s 64
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import statistics
import sys
import tempfile
from datetime import timedelta

import throttled_fs  # beside this script; registers the "throttled" fsspec protocol (spawned ranks too)
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import gockpt
from gockpt.sharded import ShardedEngine

MIB = 2**20


def _worker(rank: int, world: int, port: int, args: argparse.Namespace, root: str) -> None:
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(port)
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world, timeout=timedelta(seconds=600))
    width = 512
    # AdamW keeps 3 tensors per parameter: the state is about 3x the parameters.
    layers = max(1, int(args.state_mib * MIB / 3 / (4 * width * width)))
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
    # One directory per setup: each has its own writer claim.
    storages = [("local disk", None, cfg)]
    if args.link_mib_s is not None:
        options = throttled_fs.storage_options(args.link_mib_s * MIB)
        storages.append((f"EMULATED {args.link_mib_s:g} MiB/s link per process", "link",
                         dataclasses.replace(cfg, storage_options=options)))
    if rank == 0:
        for _, tag, _ in storages:
            for kind in ("one", "shared"):
                os.makedirs(f"{root}/{kind}{'-' + tag if tag else ''}")
    dist.barrier()
    setups = []  # (name, storage label, directory, single engine (rank 0) or None, shared engine or None)
    for label, tag, config in storages:
        suffix = f"-{tag}" if tag else ""
        setups.append(("1 writer", label, f"{root}/one{suffix}",
                       gockpt.Engine(ddp.module, opt, config) if rank == 0 else None, None))
        setups.append((f"{world} sharing writers", label, f"{root}/shared{suffix}", None,
                       ShardedEngine(ddp, opt, config, replicated=True, commit_timeout_s=600)))
    link = throttled_fs.get_link("default", args.link_mib_s * MIB) if args.link_mib_s else None
    times: list[list[tuple[float, float]]] = [[] for _ in setups]
    linked: list[list[int]] = [[] for _ in setups]  # bytes through each rank's link, last checkpoint
    # Per rank, the last checkpoint's (persist_s, time_to_durable_s, persist, state, host bytes).
    sizes: list[list] = [[] for _ in setups]
    i = 1
    for c in range(args.checkpoints + 1):  # the first round warms up (page cache, threads)
        for s, (_, _, folder, single, shared) in enumerate(setups):
            step(i)
            i += 1
            sent = link.bytes_sent if link is not None else 0
            if shared is None:  # rank 0 writes everything
                if single is not None:
                    h = single.save(f"{folder}/{c}")
                    step(i)  # lazy: the copy window is the next step's forward/backward
                    m = h.result()
                    mine = (m.persist_s, m.time_to_durable_s, m.persist_bytes, m.state_bytes, m.host_bytes)
                else:
                    step(i)
                    mine = None
            else:
                sh = shared.save(f"{folder}/{c}")
                step(i)
                shared.wait()
                part = sh.part.metrics
                mine = (part.persist_s, part.time_to_durable_s, part.persist_bytes, part.state_bytes,
                        part.host_bytes)
            i += 1
            views: list = [None] * world
            dist.all_gather_object(views, (mine, (link.bytes_sent if link is not None else 0) - sent))
            if c and rank == 0:
                ran = [v[0] for v in views if v[0] is not None]
                times[s].append((max(v[0] for v in ran), max(v[1] for v in ran)))
                linked[s] = [v[1] for v in views]
                sizes[s] = [v[0] for v in views]
    for _, _, _, single, shared in setups:
        if single is not None:
            single.close()
        if shared is not None:
            shared.close()
    if rank == 0:
        _report(args, world, root, ddp, opt, setups, times, linked, sizes)
    # End without tearing the gloo group down from Python: on torch 2.x destroying it while the
    # DDP reducer still holds work of the other rank can hang or abort at random.
    dist.barrier()
    sys.stdout.flush()
    os._exit(0)


def _report(args, world, root, ddp, opt, setups, times, linked, sizes) -> None:
    state = sum(t.numel() * t.element_size() for t in ddp.module.state_dict().values())
    state += sum(t.numel() * t.element_size() for st in opt.state.values()
                 for t in st.values() if isinstance(t, torch.Tensor))
    med = lambda xs, j: statistics.median(x[j] for x in xs)  # noqa: E731
    mib = lambda b: f"{b / MIB:.1f} MiB"  # noqa: E731
    print(f"DDP on CPU over gloo, {world} processes, AdamW, {state / MIB:.1f} MiB of state, "
          f"mode lazy, medians over {args.checkpoints} checkpoints (files fsynced to {root})")
    one, shares = sizes[0][0], sizes[1]
    print(f"  1 writer: rank 0 copies {mib(one[3])} to a {mib(one[4])} host slot; "
          f"sharing: per rank {[mib(v[3]) for v in shares]} copied, "
          f"{[mib(v[4]) for v in shares]} host slots, {[mib(v[2]) for v in shares]} written")
    ratios = [med(times[k + 1], 0) / med(times[k], 0) for k in range(0, len(setups), 2)]
    if args.link_mib_s is None:  # the local disk only
        print(f"  {'setup':<22} {'persist_s':>10} {'request->durable_s':>19}")
        for (name, *_), ts in zip(setups, times, strict=True):
            print(f"  {name:<22} {med(ts, 0):>10.3f} {med(ts, 1):>19.3f}")
        print(f"  persist time ratio (sharing / 1 writer): {ratios[0]:.2f} "
              f"(ideal {1 / world:.2f}; the {world} processes share this machine's CPUs and disk)")
        return
    width = max(len(label) for _, label, *_ in setups)
    print(f"  {'setup':<22} {'storage':<{width}} {'persist_s':>10} {'request->durable_s':>19}")
    for (name, label, *_), ts in zip(setups, times, strict=True):
        print(f"  {name:<22} {label:<{width}} {med(ts, 0):>10.3f} {med(ts, 1):>19.3f}")
    for k, ratio in enumerate(ratios):
        print(f"  persist time ratio (sharing / 1 writer), {setups[2 * k][1]}: {ratio:.2f} "
              f"(ideal {1 / world:.2f})")
    through = [[mib(b) for b in linked[k]] for k in (2, 3)]
    print(f"  local disk: the {world} processes share this machine's CPUs and disk.")
    print(f"  EMULATED rows: each process's writes are paced to {args.link_mib_s:g} MiB/s "
          f"({args.link_mib_s * MIB / 1e6:.1f} MB/s) by a link of its own (examples/throttled_fs.py, "
          f"fsspec protocol {throttled_fs.PROTOCOL!r}), as with one NIC or disk per node; the files "
          f"still go to this machine's disk. Bytes through each rank's link per checkpoint: "
          f"1 writer {through[0]}, sharing {through[1]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2, help="processes (ranks)")
    ap.add_argument("--state-mib", type=float, default=96.0, help="model + AdamW state, MiB")
    ap.add_argument("--checkpoints", type=int, default=5, help="measured checkpoints per setup")
    ap.add_argument("--dir", default=None, help="checkpoint directory (default: a temporary one)")
    ap.add_argument("--link-mib-s", type=float, default=None,
                    help="also run both setups with an EMULATED storage link of this many MiB/s "
                         "per process (writes paced; default: no emulated rows)")
    args = ap.parse_args()
    if args.link_mib_s is not None and not args.link_mib_s > 0:
        ap.error("--link-mib-s must be > 0")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        mp.spawn(_worker, args=(args.world, port, args, root), nprocs=args.world)


if __name__ == "__main__":
    main()
