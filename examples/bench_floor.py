"""Is a checkpoint's extra wall time within the noise of training without one?

One process trains the example model (one training thread, ``examples/workload.py``) in rounds.
Each round runs, in a shuffled order, one block of ``--steps`` steps per condition:

- ``none`` and ``none (again)``: no checkpoint. Their difference is the noise floor: what two
  blocks of the same work differ by on this machine at this time;
- ``disk only``: at each checkpoint step another process writes as many bytes as the state
  holds, ``O_DIRECT`` and fsync (``bench_interference.serve_writes``), copying and checksumming
  nothing; a write not done by the next checkpoint step is waited for, and the block's time
  includes the wait for the last one. What GoCkpt's persist cannot avoid on this disk;
- ``gockpt <mode>``: a :class:`gockpt.Engine`, built and warmed up before the first round (so
  every measured save reuses its host buffers), saves the real state every ``--interval``
  steps, to local disk with fsync. The block's time includes the wait, after its last step,
  for its last checkpoint to be durable, so no background work is left uncounted. The engine
  stays attached in the ``none`` blocks: what they measure with it is its per-step hooks with
  no save in flight (a few microseconds a step), so the difference is the cost of the saves.

Per round and condition: extra wall time per checkpoint = (block time - the round's ``none``
block time) / checkpoints in the block. Printed: the median over rounds and a bootstrap 90 %
interval of the mean, for each condition and for the floor (``none (again)``, divided by the
same number of checkpoints), and GoCkpt's own count of the training thread's waits
(``CheckpointMetrics.stall_s``). The extra wall time is then split, per checkpoint, into the
training thread's extra CPU time (``time.thread_time``: its own work, GoCkpt's requests
included, and any slowdown of its kernels by the background work's memory traffic) and its
extra time off the CPU (wall less CPU: waits for the GIL, a lock or a core, and for the
block's last save or write to finish), and that in turn into its part in the wait for the
last save or write, the time runnable but waiting for a core while training (the run queue,
Linux's ``/proc/thread-self/schedstat``) and the rest while training (blocked on the GIL, a
lock or a sleep). ``--chunk-bytes`` sets ``GoCkptConfig.chunk_bytes``; ``--link-gbps`` emulates a
slow device-to-host link (``GoCkptConfig.host_link_bytes_per_s``, an emulation: the copy thread
sleeps), so that a save's copy spans several steps as on an accelerator;
``--when-changed`` sets ``frozen_copy="when_changed"``. Blocks of one round
run back to back and in a new order each round, so a slow drift of a shared machine hits every
condition alike. Denormal floats are flushed to zero (``torch.set_flush_denormal``) unless
``--keep-denormals``: after some 500 steps the example model's CPU training reaches denormal
values and its steps slow down by half over the next few hundred steps (with or without
GoCkpt), a drift far larger than what is measured here. Usage::

    python examples/bench_floor.py --rounds 10 --nice -20
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import statistics
import sys
import tempfile
import time

import numpy as np


def bootstrap_interval(values: list[float], *, level: float = 0.9, draws: int = 4000,
                       seed: int = 0) -> tuple[float, float]:
    """A percentile-bootstrap ``level`` interval of the mean of ``values`` (same unit)."""
    rng = np.random.default_rng(seed)
    x = np.asarray(values, dtype=float)
    means = rng.choice(x, size=(draws, len(x)), replace=True).mean(axis=1)
    lo, hi = np.quantile(means, [(1 - level) / 2, (1 + level) / 2])
    return float(lo), float(hi)


def run_queue_s(path: str = "/proc/thread-self/schedstat") -> float | None:
    """Seconds the calling thread has spent runnable but waiting for a core: the second field
    of Linux's ``schedstat`` (nanoseconds) at ``path``; None where the kernel does not say
    (no such file, or a kernel without scheduler statistics)."""
    try:
        with open(path) as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--steps", type=int, default=40, help="steps per block (a multiple of --interval)")
    parser.add_argument("--interval", type=int, default=10, help="steps between checkpoints")
    parser.add_argument("--preset", default="bench", help="examples/workload.py preset")
    parser.add_argument("--workload", default="fp32", help="examples/workload.py workload")
    parser.add_argument("--mode", default="auto", help="GoCkpt mode (GoCkptConfig.mode)")
    parser.add_argument("--chunk-bytes", type=int, default=None,
                        help="GoCkptConfig.chunk_bytes (default: the config's default)")
    parser.add_argument("--link-gbps", type=float, default=None,
                        help="emulated device-to-host link, GB/s (GoCkptConfig.host_link_bytes_per_s); "
                             "default: none, memory-speed copies")
    parser.add_argument("--when-changed", action="store_true",
                        help='GoCkptConfig(frozen_copy="when_changed")')
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory under .)")
    parser.add_argument("--nice", type=int, default=None, help="niceness of this process (root for < 0)")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (the steps then slow down as training goes on)")
    args = parser.parse_args()
    if args.steps % args.interval:
        parser.error("--steps must be a multiple of --interval")
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from bench_interference import clear_dir, start_writer_process
    from workload import bench_training, state_nbytes

    import gockpt

    model, opt, train_step, data = bench_training(args.workload, args.preset, nice=args.nice,
                                                  keep_denormals=args.keep_denormals)
    nbytes = 0  # what ``disk only`` writes: set once the optimizer state exists
    writer = start_writer_process()
    root = tempfile.mkdtemp(prefix=".bench-floor-", dir=args.dir or ".")
    engine_kind = f"gockpt {args.mode}"
    engine: gockpt.Engine | None = None  # one: two on one optimizer would both hook every step
    saves = args.steps // args.interval
    stalls: list[float] = []  # the engine's own stall per measured save
    persisted: list[int] = []  # bytes the engine wrote per measured save

    def block(kind: str, tag: str) -> tuple[float, float, float, float | None]:
        """For ``args.steps`` steps under ``kind``, the last save's wait included: wall and
        training-thread CPU seconds; the seconds off the CPU in that wait (wall less CPU: the
        engine may finish copies on the training thread there); and the training thread's
        seconds runnable but waiting for a core while it trained (:func:`run_queue_s`; None
        where the kernel does not say)."""
        saving = engine if kind == engine_kind else None
        handles, pending = [], False
        queued = run_queue_s()
        start, cpu_start = time.perf_counter(), time.thread_time()
        for i in range(args.steps):
            train_step(model, opt, next(data))
            if kind == "disk only" and i % args.interval == 0:
                if pending and not writer.stdout.readline():
                    raise RuntimeError("the writer process ended")
                writer.stdin.write(f"{os.path.join(root, 'bytes')} {nbytes}\n")
                writer.stdin.flush()
                pending = True
            if saving is not None:
                saving.step_end()
                if i % args.interval == 0:
                    handles.append(saving.save(os.path.join(root, f"{tag}-{i}")))
        trained, trained_cpu, trained_queue = time.perf_counter(), time.thread_time(), run_queue_s()
        if saving is not None:
            saving.wait()
        if pending and not writer.stdout.readline():
            raise RuntimeError("the writer process ended")
        end, end_cpu = time.perf_counter(), time.thread_time()
        took, cpu = end - start, end_cpu - cpu_start
        tail_off = (end - trained) - (end_cpu - trained_cpu)
        queued = None if queued is None or trained_queue is None else trained_queue - queued
        for h in handles:
            m = h.result()
            if not tag.startswith("warm"):
                stalls.append(m.stall_s)
                persisted.append(m.persist_bytes)
        clear_dir(root)  # untimed: no block pays for the one before it
        return took, cpu, tail_off, queued

    kinds = ["none", "none (again)", "disk only", engine_kind]
    extra: dict[str, list[float]] = {k: [] for k in kinds[1:]}
    extra_cpu: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # training thread's CPU
    extra_tail: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # off the CPU in the last wait
    extra_queue: dict[str, list[float]] = {k: [] for k in kinds[1:]}  # waiting for a core
    order_rng = random.Random(0)
    try:
        engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(
            mode=args.mode,
            host_link_bytes_per_s=None if args.link_gbps is None else args.link_gbps * 1e9,
            **({"frozen_copy": "when_changed"} if args.when_changed else {}),
            **({} if args.chunk_bytes is None else {"chunk_bytes": args.chunk_bytes})))
        for _ in range(3):
            train_step(model, opt, next(data))
        # After the first steps: before them the optimizer holds no state, and the weights
        # alone are a third of an AdamW checkpoint.
        state_bytes = state_nbytes(model, opt)
        nbytes = -(-state_bytes // 4096) * 4096  # O_DIRECT writes whole pages
        print(f"{state_bytes / 1e6:.0f} MB of state, {args.steps} steps per block, "
              f"a checkpoint every {args.interval} ({saves} per block), {args.rounds} rounds, "
              f"mode {args.mode}"
              f"{'' if args.link_gbps is None else f', emulated link {args.link_gbps} GB/s'}"
              f"{', frozen_copy when_changed' if args.when_changed else ''}, denormals "
              f"{'kept' if args.keep_denormals else 'flushed to zero'}", flush=True)
        block(engine_kind, "warm")  # host buffers allocated, plans costed, the replay self-check run
        for r in range(args.rounds):
            order = kinds[:]
            order_rng.shuffle(order)
            got = {k: block(k, f"r{r}-{k.replace(' ', '_')}") for k in order}
            took = {k: wall for k, (wall, *_) in got.items()}
            for k in kinds[1:]:
                extra[k].append((took[k] - took["none"]) / saves)
                extra_cpu[k].append((got[k][1] - got["none"][1]) / saves)
                extra_tail[k].append((got[k][2] - got["none"][2]) / saves)
                if got[k][3] is not None and got["none"][3] is not None:
                    extra_queue[k].append((got[k][3] - got["none"][3]) / saves)
            print(f"round {r}: none {took['none'] / args.steps:.3f} s/step; extra per checkpoint "
                  + ", ".join(f"{k} {extra[k][-1]:+.3f} s" for k in kinds[1:]), flush=True)
    finally:
        writer.stdin.close()
        writer.wait()
        if engine is not None:
            engine.close()
        shutil.rmtree(root, ignore_errors=True)
    print(f"\nbytes per checkpoint (the engine's: median): disk_only={nbytes} "
          f"engine={statistics.median(persisted):.0f}")
    print("\n| condition | extra wall per checkpoint, median (s) | mean, 90 % interval (s) | engine stall, median (s) |")
    print("|---|---:|---|---:|")
    for k in kinds[1:]:
        lo, hi = bootstrap_interval(extra[k])
        own = f"{statistics.median(stalls):.4f}" if k == engine_kind else "-"
        name = f"{k} (the floor)" if k == "none (again)" else k
        print(f"| {name} | {statistics.median(extra[k]):+.3f} | {statistics.mean(extra[k]):+.3f} "
              f"[{lo:+.3f}, {hi:+.3f}] | {own} |")
    print("\nThe training thread's share of it, per checkpoint: its extra CPU time and its extra "
          "time off the CPU (wall less CPU), means over rounds with bootstrap 90 % intervals. "
          "The time off the CPU is split into its part in the wait for the block's last save or "
          "write after its last step, the time runnable but waiting for a core while training "
          "(the run queue, /proc/thread-self/schedstat; n/a where the kernel does not say), and "
          "the rest while training (blocked: the GIL, a lock, a sleep).\n")
    print("| condition | training-thread CPU (s) | off the CPU (s) | in the last save's wait (s) "
          "| waiting for a core (s) | blocked while training (s) |")
    print("|---|---|---|---|---|---|")

    def cell(values: list[float]) -> str:
        if not values:
            return "n/a"
        lo, hi = bootstrap_interval(values)
        return f"{statistics.mean(values):+.4f} [{lo:+.4f}, {hi:+.4f}]"

    for k in kinds[1:]:
        name = f"{k} (the floor)" if k == "none (again)" else k
        off = [w - c for w, c in zip(extra[k], extra_cpu[k], strict=True)]  # wall less CPU
        training = [o - t for o, t in zip(off, extra_tail[k], strict=True)]
        queued = extra_queue[k]
        blocked = ([o - q for o, q in zip(training, queued, strict=True)]
                   if len(queued) == len(training) else [])
        cells = [cell(v) for v in (extra_cpu[k], off, extra_tail[k], queued, blocked)]
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
