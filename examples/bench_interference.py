"""Who slows the training step while a checkpoint is written: the disk, or GoCkpt?

One process trains the example Llama (one training thread, ``examples/workload.py``) and, in
rounds, measures ``--steps`` steps under each of these conditions in turn, so that a slow drift of
a shared machine hits every condition alike:

- ``none``: nothing else runs;
- ``process writer``: another process writes the checkpoint's bytes (made up) to one file over
  and over, ``O_DIRECT`` and fsync, with 4 MiB writes;
- ``thread writer``: the same, from a thread of the training process (the GIL released in
  every write, as GoCkpt's io threads do);
- ``gockpt <mode>``: :class:`gockpt.Engine` saves the real state, the next save requested at the
  first step after the previous one is durable (copy, checksum, write and fsync back to back);
- ``thread writer at <f>`` (``--paced f ...``): the thread writer held to ``f`` times the rate
  the unpaced one reached in the same round, so that the cost of each byte written can be
  compared at a full and a throttled rate (is the slowdown per GB the same when the same
  bytes are spread over more steps?).

Printed: per round, each condition's median step over that round's ``none``; then the median
of those ratios over the rounds and their spread (min to max), which is the noise to read the
ratios against; with ``--paced``, for the thread writers also the extra step time per GB
written (the measured steps' time less the round's ``none`` block's, divided by the GB the
writer wrote meanwhile) and the rate each reached.
Writers write for the whole measured block, so these are upper bounds on a checkpoint's
slowdown per step while it is written. Denormal floats are flushed to zero unless
``--keep-denormals`` (as in ``bench_floor.py``). Usage::

    python examples/bench_interference.py --rounds 5
"""

from __future__ import annotations

import argparse
import mmap
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

CHUNK = 4 << 20


def aligned_buffer(nbytes: int) -> mmap.mmap:
    """``nbytes`` of made-up data, page-aligned (as ``O_DIRECT`` needs), every page touched."""
    buf = mmap.mmap(-1, nbytes)
    for i in range(0, nbytes, 1 << 20):
        n = min(1 << 20, nbytes - i)
        buf[i:i + n] = bytes([(i >> 20) & 255]) * n
    return buf


class Pacer:
    """Holds a writer to ``bytes_per_s`` over all its writes, across files (sleeps only)."""

    def __init__(self, bytes_per_s: float) -> None:
        if not bytes_per_s > 0:
            raise ValueError(f"bytes_per_s must be > 0, got {bytes_per_s}")
        self.bytes_per_s = bytes_per_s
        self.t0 = time.perf_counter()
        self.nbytes = 0

    def wrote(self, n: int) -> None:
        """``n`` more bytes were written: sleep until the rate allows them."""
        self.nbytes += n
        ahead = self.nbytes / self.bytes_per_s - (time.perf_counter() - self.t0)
        if ahead > 0:
            time.sleep(ahead)


def write_file(path: str, view: memoryview, stop: threading.Event | None = None,
               pacer: Pacer | None = None, written: list[int] | None = None) -> None:
    """Write ``view`` (a multiple of 4096 bytes) to ``path`` in ``CHUNK`` writes, with
    ``O_DIRECT`` where the file system takes it (else through the page cache, as on tmpfs),
    then fsync; stops early once ``stop`` is set. ``pacer``: holds the writes to its rate;
    ``written[0]`` counts the bytes written.

    Raises:
        OSError: the file could not be opened, written or fsynced (a full disk: ENOSPC).
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC
    try:
        fd = os.open(path, flags | getattr(os, "O_DIRECT", 0))
        os.write(fd, view[:4096])  # some file systems refuse O_DIRECT only at the first write
        os.lseek(fd, 0, 0)
    except OSError:
        fd = os.open(path, flags)
    try:
        for i in range(0, len(view), CHUNK):
            if stop is not None and stop.is_set():
                break
            n = os.write(fd, view[i:i + CHUNK])
            if written is not None:
                written[0] += n
            if pacer is not None:
                pacer.wrote(n)
        os.fsync(fd)
    finally:
        os.close(fd)


def clear_dir(root: str) -> None:
    """Remove everything inside ``root`` (files and directories), keeping ``root``."""
    for name in os.listdir(root):
        p = os.path.join(root, name)
        shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)


def serve_writes() -> None:
    """The writer process: per line ``path nbytes`` on stdin (nbytes a multiple of 4096), write
    that many made-up bytes to ``path`` (:func:`write_file`) and answer the path on stdout; ends
    when stdin closes. An ``OSError`` of a write ends the process (the caller sees it exit)."""
    buf = None
    for line in sys.stdin:
        path, n = line.split()
        if buf is None or len(buf) < int(n):
            buf = aligned_buffer(int(n))
        write_file(path, memoryview(buf)[:int(n)])
        print(path, flush=True)


def start_writer_process() -> subprocess.Popen:
    """Another Python process running :func:`serve_writes` (text pipes)."""
    return subprocess.Popen([sys.executable, os.path.abspath(__file__), "--serve-writes"],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _feed(proc: subprocess.Popen, path: str, nbytes: int, stop: threading.Event) -> None:
    """Keep the writer process writing until ``stop`` (then it is killed: the pipe breaks)."""
    try:
        while not stop.is_set():
            proc.stdin.write(f"{path} {nbytes}\n")
            proc.stdin.flush()
            if not proc.stdout.readline():
                return
    except (BrokenPipeError, ValueError):
        return


def _thread_writer(nbytes: int, path: str, stop: threading.Event, bytes_per_s: float | None,
                   written: list[int]) -> None:
    view = memoryview(aligned_buffer(nbytes))
    pacer = None if bytes_per_s is None else Pacer(bytes_per_s)
    while not stop.is_set():
        write_file(path, view, stop, pacer, written)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per condition and round")
    parser.add_argument("--preset", default="bench", help="examples/workload.py preset")
    parser.add_argument("--modes", nargs="*", default=["lazy"], help="GoCkpt modes to add as conditions")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory under .)")
    parser.add_argument("--nice", type=int, default=None, help="niceness of this process (root for < 0)")
    parser.add_argument("--keep-denormals", action="store_true",
                        help="do not flush denormal floats to zero (see bench_floor.py: the steps "
                             "then slow down as training goes on)")
    parser.add_argument("--paced", nargs="*", type=float, default=[],
                        help="add the thread writer held to these fractions of its unpaced rate")
    parser.add_argument("--serve-writes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if any(not f > 0 for f in args.paced):
        parser.error("--paced fractions must be > 0")
    if args.serve_writes:
        serve_writes()
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from workload import bench_training, state_nbytes

    import gockpt

    model, opt, train_step, data = bench_training("fp32", args.preset, nice=args.nice,
                                                  keep_denormals=args.keep_denormals)
    for _ in range(3):
        train_step(model, opt, next(data))
    nbytes = -(-state_nbytes(model, opt) // 4096) * 4096  # O_DIRECT writes whole pages
    root = tempfile.mkdtemp(prefix=".bench-interference-", dir=args.dir or ".")
    target = os.path.join(root, "bytes")

    def measure(kind: str, bytes_per_s: float | None = None) -> tuple[float, float, int]:
        """Median step (s), sum of the steps (s) and bytes the writer wrote meanwhile under
        ``kind``."""
        stop, helper, proc, engine, handles = threading.Event(), None, None, None, []
        written = [0]
        if kind == "process writer":
            proc = start_writer_process()
            helper = threading.Thread(target=_feed, args=(proc, target, nbytes, stop))
            helper.start()
        elif kind.startswith("thread writer"):
            helper = threading.Thread(target=_thread_writer,
                                      args=(nbytes, target, stop, bytes_per_s, written))
            helper.start()
        elif kind.startswith("gockpt "):
            engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=kind.split()[1]))
        time.sleep(0.3)  # the writer under way
        times = []
        w0 = written[0]
        for i in range(args.steps):
            t = time.perf_counter()
            train_step(model, opt, next(data))
            if engine is not None:
                engine.step_end()
                if not handles or handles[-1].done():
                    handles.append(engine.save(os.path.join(root, f"ckpt-{len(handles)}")))
            times.append(time.perf_counter() - t)
        wrote = written[0] - w0
        stop.set()
        if proc is not None:
            proc.kill()
            proc.wait()
        if helper is not None:
            helper.join()
        if engine is not None:
            engine.close()
            for h in handles:
                h.result()
        clear_dir(root)
        return statistics.median(times), sum(times), wrote

    paced = [f"thread writer at {f:g}" for f in args.paced]
    kinds = ["none", "process writer", "thread writer", *paced, *(f"gockpt {m}" for m in args.modes)]
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    per_gb: dict[str, list[float]] = {k: [] for k in ["thread writer", *paced]}
    reached: dict[str, list[float]] = {k: [] for k in per_gb}  # bytes/s each writer reached
    print(f"{nbytes / 1e6:.0f} MB per write, {args.steps} steps per condition, "
          f"{args.rounds} rounds; median step over the round's 'none'")
    try:
        for r in range(args.rounds):
            base, base_total, _ = measure("none")
            row = {"none": 1.0}
            full_rate = 0.0
            for k, f in zip(kinds[1:], [None, None, *args.paced, *([None] * len(args.modes))]):
                if f is not None and not full_rate:
                    continue  # the unpaced writer finished no write this round: nothing to pace to
                median, total, wrote = measure(k, None if f is None else f * full_rate)
                row[k] = median / base
                if k == "thread writer":
                    full_rate = wrote / total
                if k in per_gb and wrote > 0:
                    # Extra seconds of the measured steps (against the round's 'none' block, whose
                    # sum holds the same long tail of slow steps) per GB written meanwhile.
                    per_gb[k].append((total - base_total) / (wrote / 1e9))
                    reached[k].append(wrote / total)
            for k, v in row.items():
                ratios[k].append(v)
            print(f"round {r}: none {base:.3f} s; " + ", ".join(f"{k} {row[k]:.3f}" for k in row if k != "none"),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| condition | median step / none (over rounds) | min | max |")
    print("|---|---:|---:|---:|")
    for k in kinds:
        print(_row(k, ratios[k]))
    if args.paced:
        print("\n| writer | extra step time per GB written (s/GB, median over rounds) | min | max "
              "| rate reached (MB/s, median) |")
        print("|---|---:|---:|---:|---:|")
        for k, v in per_gb.items():
            rate = f"{statistics.median(reached[k]) / 1e6:.0f}" if reached[k] else "-"
            print(f"{_row(k, v)} {rate} |")


def _row(name: str, values: list[float]) -> str:
    """A table row: median, min and max of ``values``; ``-`` where a condition never ran."""
    if not values:
        return f"| {name} | - | - | - |"
    return f"| {name} | {statistics.median(values):.3f} | {min(values):.3f} | {max(values):.3f} |"


if __name__ == "__main__":
    main()
