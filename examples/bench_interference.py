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
  first step after the previous one is durable (copy, checksum, write and fsync back to back).

Printed: per round, each condition's median step over that round's ``none``; then the median
of those ratios over the rounds and their spread (min to max), which is the noise to read the
ratios against. Writers write for the whole measured block, so these are upper bounds on a
checkpoint's slowdown per step while it is written. Usage::

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


def write_file(path: str, view: memoryview, stop: threading.Event | None = None) -> None:
    """Write ``view`` (a multiple of 4096 bytes) to ``path`` in ``CHUNK`` writes, with
    ``O_DIRECT`` where the file system takes it (else through the page cache, as on tmpfs),
    then fsync; stops early once ``stop`` is set.

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
            os.write(fd, view[i:i + CHUNK])
        os.fsync(fd)
    finally:
        os.close(fd)


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


def _thread_writer(nbytes: int, path: str, stop: threading.Event) -> None:
    view = memoryview(aligned_buffer(nbytes))
    while not stop.is_set():
        write_file(path, view, stop)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=20, help="measured steps per condition and round")
    parser.add_argument("--preset", default="bench", help="examples/workload.py preset")
    parser.add_argument("--modes", nargs="*", default=["lazy"], help="GoCkpt modes to add as conditions")
    parser.add_argument("--dir", default=None, help="where to write (default: a temporary directory under .)")
    parser.add_argument("--nice", type=int, default=None, help="niceness of this process (root for < 0)")
    parser.add_argument("--serve-writes", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve_writes:
        serve_writes()
        return

    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import torch
    from workload import PRESETS, build_training, make_dataloader, state_nbytes, text_datasets

    import gockpt

    if args.nice is not None:
        os.nice(args.nice - os.nice(0))
    torch.set_num_threads(1)
    preset = PRESETS[args.preset]
    model, opt, train_step = build_training("fp32", args.preset, seed=0)
    train, _ = text_datasets(seq_len=preset.seq_len)
    loader = make_dataloader(train, preset.batch_size, seed=0)

    def batches():
        while True:
            yield from loader

    data = batches()
    for _ in range(3):
        train_step(model, opt, next(data))
    nbytes = -(-state_nbytes(model, opt) // 4096) * 4096  # O_DIRECT writes whole pages
    root = tempfile.mkdtemp(prefix=".bench-interference-", dir=args.dir or ".")
    target = os.path.join(root, "bytes")

    def measure(kind: str) -> float:
        stop, helper, proc, engine, handles = threading.Event(), None, None, None, []
        if kind == "process writer":
            proc = start_writer_process()
            helper = threading.Thread(target=_feed, args=(proc, target, nbytes, stop))
            helper.start()
        elif kind == "thread writer":
            helper = threading.Thread(target=_thread_writer, args=(nbytes, target, stop))
            helper.start()
        elif kind.startswith("gockpt "):
            engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=kind.split()[1]))
        time.sleep(0.3)  # the writer under way
        times = []
        for i in range(args.steps):
            t = time.perf_counter()
            train_step(model, opt, next(data))
            if engine is not None:
                engine.step_end()
                if not handles or handles[-1].done():
                    handles.append(engine.save(os.path.join(root, f"ckpt-{len(handles)}")))
            times.append(time.perf_counter() - t)
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
        for name in os.listdir(root):
            p = os.path.join(root, name)
            shutil.rmtree(p) if os.path.isdir(p) else os.unlink(p)
        return statistics.median(times)

    kinds = ["none", "process writer", "thread writer", *(f"gockpt {m}" for m in args.modes)]
    ratios: dict[str, list[float]] = {k: [] for k in kinds}
    print(f"{nbytes / 1e6:.0f} MB per write, {args.steps} steps per condition, "
          f"{args.rounds} rounds; median step over the round's 'none'")
    try:
        for r in range(args.rounds):
            base = measure("none")
            row = {"none": 1.0}
            for k in kinds[1:]:
                row[k] = measure(k) / base
            for k, v in row.items():
                ratios[k].append(v)
            print(f"round {r}: none {base:.3f} s; " + ", ".join(f"{k} {row[k]:.3f}" for k in kinds[1:]),
                  flush=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    print("| condition | median step / none (over rounds) | min | max |")
    print("|---|---:|---:|---:|")
    for k in kinds:
        v = ratios[k]
        print(f"| {k} | {statistics.median(v):.3f} | {min(v):.3f} | {max(v):.3f} |")


if __name__ == "__main__":
    main()
