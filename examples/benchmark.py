"""What a checkpoint costs the training: GoCkpt against Lightning, PyTorch DCP and Accelerate.

One command (``python examples/benchmark.py``, under 10 minutes on 2 cores) trains the example
Llama on the ``pydoc_data`` text with ``torch.set_num_threads(1)``, so that the second core plays
the part of a GPU's copy engine and host CPU, and checkpoints every ``--interval`` steps with each
scheme in turn, each scheme in a fresh process (forked from a parent that has only imported the
libraries). The schemes are driven from the same plain PyTorch loop: a save is requested right
after ``optimizer.step()``; Lightning's CheckpointIO plugins get the dict a Trainer would build.
``host-snapshot`` is a reference floor, not a product: a memcpy into a preallocated buffer and one
thread writing it to a single file. ``disk-only`` is the floor below it: another process writes as
many bytes as the checkpoint holds (O_DIRECT and fsync, as GoCkpt's persist) while the training
process copies nothing, so its steps show what writing a checkpoint costs training on this
machine's disk at all.

Measured per scheme (definitions are also printed and written next to the table):

- stall per checkpoint: ``(sum of measured step times - N * clean step) / checkpoints``, where the
  clean step is the median of the same process's steps with no checkpoint in flight: blocks of
  steps before and after the measured ones, and the measured steps that started once the latest
  checkpoint was complete (the measured run's plain median would hide a slowdown that lasts most
  of an interval, as a copy spread over 7 of 10 steps does; clean blocks alone would count a
  slow drift of a shared machine as stall). It holds the save call and any slowdown of the
  following steps (a writer thread taking the GIL, a core or memory bandwidth). The same number
  for ``none`` is the noise floor.
- throughput: measured steps per second relative to ``none``.
- time to durable: from the save request until the scheme reports the checkpoint complete
  (after fsync where the scheme fsyncs; otherwise when its writes returned: marked ``no``).
- persist bandwidth relative to this machine's raw write+fsync bandwidth of the same number of
  bytes, measured in the same run. GoCkpt reports its persist phase; for the others the save
  call (or its future) is the only observable, so serialization counts as persist time.
- restore time relative to reading the same files raw, both from a cold page cache: every file is
  fsynced and dropped with ``posix_fadvise(POSIX_FADV_DONTNEED)`` before each timing.
- peak host memory: ``ru_maxrss`` of the scheme process after training, before the restore.
- step during a checkpoint: the median of the measured steps that started while a checkpoint was
  in flight (its own step excluded) against the clean step, side by side from the same process.
- timeline (GoCkpt rows, ``bench_timeline.py``): for one checkpoint that overlapped no other, per
  background thread and phase (copy, replay, serialize, write, checksum, fsync, manifest,
  publish, latest) the first start and last end after the request, busy wall time, CPU time,
  and the thread's CPU time between phases (Python holding the GIL); and per phase, how much
  slower the steps it covered were.

``--host-link-gbps`` throttles GoCkpt's copy worker by sleeping (``host_link_bytes_per_s``), so a
full snapshot spans several steps as on a real device-to-host link; by default the rate is chosen
so that a full copy takes 4 measured steps. Those rows are labelled "emulated" everywhere. The
sleep stands in for the link's transfer time only: the copies themselves still run as memcpys on
the second core and compete with training for memory bandwidth, which a device's DMA would not.

The emulated-link rows also show the planner's plan of each save (mode and K), its predicted
stall and the lower bound no plan could beat (``gockpt.plan``), next to the engine-reported and
the wall-clock stall per checkpoint (medians over the measured saves) and their ratios to the
prediction. ``--workload`` picks the training set-up (``examples/workload.py``: ``fp32``, the
default; ``bf16-autocast``; ``bf16-master``; ``lora``), whose gradients are a different share of
the state; ``--emulated-only`` runs just ``none`` and the emulated-link rows (and ``disk-only``,
the write's floor, where ``--schemes`` names it).

``--io-nice N`` adds GoCkpt lazy and auto rows with ``GoCkptConfig(io_nice=N)`` beside the
default rows, in the same run; ``--buffered`` adds GoCkpt lazy and gockpt_o rows that write
their shard files through the page cache (``GoCkptConfig(direct_io=False)``), the default being
``O_DIRECT``. ``--window-quantile Q`` adds, ``--forecast-rounds`` times, the emulated-link auto
row at ``GoCkptConfig(window_quantile=0.5)`` (the median) and then at ``Q``, and reports each
forecast's median measured / predicted stall over its rounds and its waits at window ends;
``--window-memory M`` does the same for ``GoCkptConfig.window_memory`` at its default and at
``M`` (both at ``--window-quantile`` where given).

On a shared machine, ``--nice -20`` (root) keeps other processes from skewing the step times;
the 'none' rows show what noise remains. ``--quick`` is a smoke run of the whole pipeline.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

STALL_DEFINITION = (
    "stall/ckpt = (sum of the N measured step times - N x clean step) / number of checkpoints, "
    "where clean step = median of the same process's steps with no checkpoint in flight "
    "({clean} before and {clean} after the measured steps, and the measured steps that started "
    "after the latest checkpoint was complete): the extra wall time per checkpoint, including the "
    "slowdown of the steps after each save; the 'none' row is the noise floor"
)
# fmt: off
SCHEMES = (
    "none", "disk-only", "host-snapshot", "lightning-torch", "lightning-async", "dcp-async", "accelerate",
    "gockpt-sync", "gockpt-async", "gockpt-lazy", "gockpt-gockpt", "gockpt-gockpt_o", "gockpt-auto",
)
EMULATED_SCHEMES = ("gockpt-lazy", "gockpt-gockpt", "gockpt-gockpt_o", "gockpt-auto")
LABELS = {
    "none": "no checkpoint", "host-snapshot": "reference: host snapshot + 1 writer thread",
    "disk-only": "reference: the same bytes written by another process",
    "lightning-torch": "Lightning TorchCheckpointIO", "lightning-async": "Lightning AsyncCheckpointIO",
    "dcp-async": "DCP async_save", "accelerate": "Accelerate save_state",
}
# Whether the scheme as shipped fsyncs its files (GoCkpt and the reference do).
FSYNCS = {"lightning-torch": False, "lightning-async": False, "dcp-async": True, "accelerate": False}
# fmt: on
CHUNK_BYTES = 64 << 20


# ---------------------------------------------------------------- raw I/O of this machine
def _files_under(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    return sorted(str(p) for p in Path(path).rglob("*") if p.is_file())


def drop_page_cache(files: list[str]) -> None:
    """Makes the next read of ``files`` cold: fsync (dirty pages cannot be dropped), then
    ``posix_fadvise(POSIX_FADV_DONTNEED)`` on each file."""
    for name in files:
        fd = os.open(name, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_raw(files: list[str]) -> tuple[int, float]:
    """Reads every file once into one reused buffer; returns (bytes, seconds)."""
    view, total = memoryview(bytearray(CHUNK_BYTES)), 0
    start = time.perf_counter()
    for name in files:
        with open(name, "rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total, time.perf_counter() - start


def measure_raw(directory: str, num_bytes: int, repeats: int = 3) -> dict[str, float]:
    """Median memcpy, write+fsync and cold-read bandwidths (GB/s) of ``num_bytes`` bytes."""
    src = bytearray(os.urandom(1 << 20)) * max(1, num_bytes >> 20)
    dst = bytearray(len(src))
    path = os.path.join(directory, "raw.bin")
    memcpy, write, read = [], [], []
    for _ in range(repeats):
        start = time.perf_counter()
        memoryview(dst)[:] = src
        memcpy.append(len(src) / (time.perf_counter() - start))
        start = time.perf_counter()
        with open(path, "wb", buffering=0) as f:
            for i in range(0, len(src), CHUNK_BYTES):
                f.write(memoryview(src)[i : i + CHUNK_BYTES])
            os.fsync(f.fileno())
        write.append(len(src) / (time.perf_counter() - start))
        drop_page_cache([path])
        n, seconds = read_raw([path])
        read.append(n / seconds)
        os.remove(path)
    return {
        "bytes": len(src),
        "memcpy_gbps": statistics.median(memcpy) / 1e9,
        "write_fsync_gbps": statistics.median(write) / 1e9,
        "cold_read_gbps": statistics.median(read) / 1e9,
    }


# ---------------------------------------------------------------- schemes (child process)
class Scheme:
    """One way to checkpoint, driven from the training loop.

    Call sequence (training thread): ``save(path, step)`` right after ``optimizer.step()``;
    ``finish()`` once after the loop; then ``restore(path)``. ``durable_s`` holds, per save,
    the seconds from the request until the checkpoint was complete.
    """

    fsync: bool | None = None

    def __init__(self, model, optimizer, args) -> None:
        self.model, self.optimizer, self.args = model, optimizer, args
        self.durable_s: list[float] = []
        self.persist_gbps: list[float] = []
        self.engine_metrics: list[dict] = []

    def save(self, path: str, step: int) -> None:
        start = time.perf_counter()
        self._save(path, step)
        self.durable_s.append(time.perf_counter() - start)

    def _save(self, path: str, step: int) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass

    def own_wait_s(self) -> float:
        """Seconds the training thread has waited inside the checkpointer's hooks between
        saves, so far (0 where the scheme has none: its cost is all in ``save``)."""
        return 0.0

    def restore(self, path: str) -> None:
        raise NotImplementedError


class LightningTorch(Scheme):
    """Lightning's default ``TorchCheckpointIO`` given the dict a Trainer would build."""

    def __init__(self, model, optimizer, args) -> None:
        from lightning.pytorch.plugins.io import TorchCheckpointIO

        super().__init__(model, optimizer, args)
        self.io = TorchCheckpointIO()

    def _checkpoint(self, step: int) -> dict:
        import lightning

        return {
            "epoch": 0,
            "global_step": step,
            "pytorch-lightning_version": lightning.__version__,
            "state_dict": self.model.state_dict(),
            "loops": {},
            "callbacks": {},
            "optimizer_states": [self.optimizer.state_dict()],
            "lr_schedulers": [],
        }

    def _save(self, path: str, step: int) -> None:
        self.io.save_checkpoint(self._checkpoint(step), path)

    def restore(self, path: str) -> None:
        checkpoint = self.io.load_checkpoint(path)
        self.model.load_state_dict(checkpoint["state_dict"])
        self.optimizer.load_state_dict(checkpoint["optimizer_states"][0])


class LightningAsync(LightningTorch):
    """Lightning's ``AsyncCheckpointIO`` (clones on the training thread, saves in a thread)."""

    def __init__(self, model, optimizer, args) -> None:
        from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

        super().__init__(model, optimizer, args)
        durable_s, requested = self.durable_s, {}
        self.requested = requested

        class _Timed(TorchCheckpointIO):
            def save_checkpoint(self, checkpoint, path, storage_options=None):
                super().save_checkpoint(checkpoint, path, storage_options)
                durable_s.append(time.perf_counter() - requested[str(path)])

        self.io = AsyncCheckpointIO(_Timed())

    def save(self, path: str, step: int) -> None:
        self.requested[path] = time.perf_counter()
        self.io.save_checkpoint(self._checkpoint(step), path)

    def finish(self) -> None:
        self.io.teardown()


class DcpAsync(Scheme):
    """``torch.distributed.checkpoint.async_save`` in one process (``no_dist=True``); a new save
    first waits for the previous one, as training loops using it do."""

    def __init__(self, model, optimizer, args) -> None:
        super().__init__(model, optimizer, args)
        self.future = None

    def _state(self) -> dict:
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def save(self, path: str, step: int) -> None:
        import torch.distributed.checkpoint as dcp

        self.finish()
        start = time.perf_counter()
        self.future = dcp.async_save(self._state(), checkpoint_id=path, no_dist=True)
        self.future.add_done_callback(lambda _: self.durable_s.append(time.perf_counter() - start))

    def finish(self) -> None:
        if self.future is not None:
            self.future.result()

    def restore(self, path: str) -> None:
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import set_state_dict

        state = self._state()
        dcp.load(state, checkpoint_id=path, no_dist=True)
        set_state_dict(
            self.model,
            self.optimizer,
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )


class AccelerateSaveState(Scheme):
    """Accelerate's ``save_state`` / ``load_state`` (model in safetensors, optimizer pickled)."""

    def __init__(self, model, optimizer, args) -> None:
        from accelerate import Accelerator

        self.accelerator = Accelerator(cpu=True)
        model, optimizer = self.accelerator.prepare(model, optimizer)
        super().__init__(model, optimizer, args)

    def _save(self, path: str, step: int) -> None:
        self.accelerator.save_state(path)

    def restore(self, path: str) -> None:
        self.accelerator.load_state(path)


class GoCkptScheme(Scheme):
    """The GoCkpt engine driven directly: ``engine.save(path)`` right after ``optimizer.step()``."""

    fsync = True

    def __init__(self, model, optimizer, args) -> None:
        from gockpt import Engine, GoCkptConfig

        super().__init__(model, optimizer, args)
        mode = args.scheme.removeprefix("gockpt-")
        options = {"num_io_threads": args.io_threads} if args.io_threads else {}
        if args.scheme_io_nice is not None:
            options["io_nice"] = args.scheme_io_nice
        if args.scheme_buffered:
            options["direct_io"] = False
        if args.scheme_when_changed:
            options["frozen_copy"] = "when_changed"
        if args.scheme_window_quantile is not None:
            options["window_quantile"] = args.scheme_window_quantile
        if args.scheme_window_memory is not None:
            options["window_memory"] = args.scheme_window_memory
        config = GoCkptConfig(
            mode=mode, host_link_bytes_per_s=args.host_link_bytes_per_s, **options
        )
        self.engine = Engine(model, optimizer, config)
        self.handles: list = []

    def save(self, path: str, step: int) -> None:
        self.handles.append(self.engine.save(path, state_fn=lambda: {"step": step}))

    def own_wait_s(self) -> float:
        # Live metrics: the engine adds each wait on the training thread as it ends.
        return sum(h.metrics.stall_s for h in self.handles)

    def finish(self) -> None:
        self.engine.wait()
        for handle in self.handles:
            metrics = handle.result()
            self.durable_s.append(metrics.time_to_durable_s)
            self.persist_gbps.append(metrics.persist_gbps)
            self.engine_metrics.append(metrics.as_dict())
        self.handles.clear()

    def restore(self, path: str) -> None:
        self.engine.restore(path)


class HostSnapshot(Scheme):
    """Reference floor, no product: memcpy every tensor into one preallocated host buffer on the
    training thread, then one thread writes it to a single file and fsyncs. No format, no
    checksums; restore reads the file back into the tensors."""

    fsync = True

    def __init__(self, model, optimizer, args) -> None:
        import torch

        super().__init__(model, optimizer, args)
        self.thread = None
        self.buffer = None
        self.torch = torch

    def _tensors(self) -> list:
        opt_state = [v for s in self.optimizer.state.values() for v in s.values()]
        tensors = list(self.model.state_dict().values()) + opt_state
        return [t for t in tensors if isinstance(t, self.torch.Tensor)]

    def save(self, path: str, step: int) -> None:
        self.finish()
        start = time.perf_counter()
        tensors = self._tensors()
        num_bytes = sum(t.numel() * t.element_size() for t in tensors)
        if self.buffer is None or self.buffer.numel() != num_bytes:
            self.buffer = self.torch.empty(num_bytes, dtype=self.torch.uint8)
        offset = 0
        for t in tensors:
            n = t.numel() * t.element_size()
            self.buffer[offset : offset + n].copy_(t.detach().reshape(-1).view(self.torch.uint8))
            offset += n
        self.thread = threading.Thread(target=self._write, args=(path, start))
        self.thread.start()

    def _write(self, path: str, start: float) -> None:
        view = memoryview(self.buffer.numpy())
        with open(path, "wb", buffering=0) as f:
            for i in range(0, len(view), CHUNK_BYTES):
                f.write(view[i : i + CHUNK_BYTES])
            os.fsync(f.fileno())
        self.durable_s.append(time.perf_counter() - start)

    def finish(self) -> None:
        if self.thread is not None:
            self.thread.join()

    def restore(self, path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            for t in self._tensors():
                f.readinto(memoryview(t.detach().reshape(-1).view(self.torch.uint8).numpy()))


class DiskOnly(Scheme):
    """Reference floor, no product: at each save another process writes as many bytes as the
    checkpoint holds (made up, not the state) to one file, O_DIRECT and fsync, as GoCkpt's
    persist does. Nothing is copied and the training process only sends it a line: its steps
    show what writing the checkpoint's bytes to this disk costs training on this machine.
    Restore reads the file into a scratch buffer."""

    fsync = True

    def __init__(self, model, optimizer, args) -> None:
        import bench_interference

        super().__init__(model, optimizer, args)
        self.proc = bench_interference.start_writer_process()  # O_DIRECT + fsync per request
        self.starts: list[float] = []  # per save request, perf_counter seconds
        self.done = 0  # writes the writer reported complete
        self.cv = threading.Condition()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()
        self.nbytes = 0

    def _read(self) -> None:
        for _ in self.proc.stdout:
            with self.cv:
                self.durable_s.append(time.perf_counter() - self.starts[self.done])
                self.done += 1
                self.cv.notify_all()
        with self.cv:  # the writer exited: wake finish()
            self.cv.notify_all()

    def save(self, path: str, step: int) -> None:
        if not self.nbytes:
            from workload import state_nbytes

            self.nbytes = -(-state_nbytes(self.model, self.optimizer) // 4096) * 4096  # whole pages
        with self.cv:
            self.starts.append(time.perf_counter())
        self.proc.stdin.write(f"{path} {self.nbytes}\n")
        self.proc.stdin.flush()

    def finish(self) -> None:
        with self.cv:
            self.cv.wait_for(lambda: self.done == len(self.starts) or not self.reader.is_alive())
            if self.done < len(self.starts):
                raise RuntimeError(f"the disk-only writer exited with {self.proc.wait()}")

    def restore(self, path: str) -> None:
        with open(path, "rb", buffering=0) as f:
            scratch = bytearray(CHUNK_BYTES)
            while f.readinto(scratch):
                pass


def _scheme_class(name: str) -> type[Scheme]:
    if name.startswith("gockpt-"):
        return GoCkptScheme
    return {
        "lightning-torch": LightningTorch,
        "lightning-async": LightningAsync,
        "dcp-async": DcpAsync,
        "accelerate": AccelerateSaveState,
        "host-snapshot": HostSnapshot,
        "disk-only": DiskOnly,
    }[name]


def _free_steps(
    times: list[float], starts: list[float], ckpt_steps: list[int], durable_at: list[float]
) -> list[float]:
    """The measured step times with no checkpoint in flight: not a checkpoint's own step, and
    started after the latest earlier checkpoint was complete (``durable_at``, perf_counter s)."""
    free, latest = [], None
    for i, (t, start) in enumerate(zip(times, starts, strict=True)):
        if i in ckpt_steps:
            latest = ckpt_steps.index(i)
        elif latest is None or (latest < len(durable_at) and start >= durable_at[latest]):
            free.append(t)
    return free


def run_scheme(args: argparse.Namespace) -> dict:
    """Trains with one scheme in this process and returns its measurements.

    Phases: ``--warmup`` steps with one checkpoint in the middle (one-time set-up such as buffer
    allocation shows up as ``first_save_extra_s``), drained; ``--clean-steps`` steps without a
    checkpoint; the measured steps, a checkpoint every ``--interval`` steps starting at the
    first; drain; ``--clean-steps`` more steps without a checkpoint. The clean step, the
    baseline of the stall, is the median of every step during which no checkpoint was in flight:
    both clean blocks, plus the measured steps that started after the latest checkpoint was
    complete (so a slow drift of the machine does not count as stall, and a checkpoint whose
    effects last most of an interval does not lower its own baseline).
    """
    import resource
    import warnings

    import bench_timeline
    import torch
    from workload import PRESETS, build_training, make_dataloader, state_nbytes, text_datasets

    from gockpt import _trace

    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    preset = PRESETS[args.preset]
    model, optimizer, train_step = build_training(args.workload, args.preset, seed=0)
    train, _ = text_datasets(args.data, seq_len=preset.seq_len)
    scheme = _scheme_class(args.scheme)(model, optimizer, args) if args.scheme != "none" else None
    if scheme is not None:
        model, optimizer = scheme.model, scheme.optimizer
    loader = make_dataloader(train, args.batch_size or preset.batch_size, seed=0)

    def batches():
        while True:
            yield from loader

    data = batches()

    starts: list[float] = []  # start of every measured step (perf_counter seconds)
    own_waits: list[float] = []  # the checkpointer's own waits inside each step (seconds)
    requests: list[float] = []  # time of every measured save request

    def step(save_path: str | None = None) -> float:
        waited = scheme.own_wait_s() if scheme is not None else 0.0  # before the step's clock
        start = time.perf_counter()
        starts.append(start)
        train_step(model, optimizer, next(data))
        if save_path is not None and scheme is not None:
            requests.append(time.perf_counter())
            scheme.save(save_path, step.count)
        step.count += 1
        elapsed = time.perf_counter() - start
        own_waits.append(scheme.own_wait_s() - waited if scheme is not None else 0.0)
        return elapsed

    step.count = 0

    def drain() -> float:
        start = time.perf_counter()
        if scheme is not None:
            scheme.finish()
        return time.perf_counter() - start

    ckpt_root = os.path.join(args.ckpt_dir, args.scheme)
    os.makedirs(ckpt_root, exist_ok=True)
    first_save_at = args.warmup // 2
    warmup = [
        step(os.path.join(ckpt_root, "warmup") if i == first_save_at else None)
        for i in range(args.warmup)
    ]
    drain()
    if scheme is not None:
        scheme.durable_s.clear(), scheme.persist_gbps.clear(), scheme.engine_metrics.clear()
    clean = [step() for _ in range(args.clean_steps)]
    starts.clear(), requests.clear(), own_waits.clear()
    times, ckpt_steps, last_path = [], [], None
    if args.scheme.startswith("gockpt-"):
        _trace.start()
    loop_start = time.perf_counter()
    for i in range(args.steps):
        path = None
        if i % args.interval == 0:
            path = last_path = os.path.join(ckpt_root, f"step-{i:05d}")
            ckpt_steps.append(i)
        times.append(step(path))
    loop_s = time.perf_counter() - loop_start
    measured_starts = starts[: len(times)]
    measured_waits = own_waits[: len(times)]
    drain_s = drain()
    events = _trace.stop()
    peak_rss_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    clean += [step() for _ in range(args.clean_steps)]
    state_bytes = state_nbytes(model, optimizer)

    durable_at = [r + d for r, d in zip(requests, scheme.durable_s, strict=False)] if scheme else []
    free = _free_steps(times, measured_starts, ckpt_steps if scheme else [], durable_at)
    base = statistics.median(clean + free)
    split = bench_timeline.step_split(times, measured_starts, ckpt_steps if scheme else [],
                                      requests, durable_at, clean + free, measured_waits)
    timeline_text = ""
    name = args.scheme + ("" if args.scheme_io_nice is None else f" [io_nice {args.scheme_io_nice}]")
    name += " [buffered]" if args.scheme_buffered else ""
    name += " [emulated link]" if args.host_link_bytes_per_s is not None else ""
    name += f" [{args.workload}]" if args.workload != "fp32" else ""
    name += config_tags(args.scheme_when_changed, args.scheme_window_quantile,
                        args.scheme_window_memory)
    if events and durable_at:
        k = bench_timeline.lone_checkpoint(requests, durable_at)
        rows = bench_timeline.timeline(events, requests[k], durable_at[k])
        slowdown = bench_timeline.phase_slowdown(
            events, times, measured_starts, split["free_median_s"])
        timeline_text = bench_timeline.format_report(name, split, rows, slowdown, k)
    elif scheme is not None:
        timeline_text = bench_timeline.format_report(name, split, [], {}, 0).split("\n")[0]
    result = {
        "scheme": args.scheme,
        "emulated": args.host_link_bytes_per_s is not None,
        "io_nice": args.scheme_io_nice,
        "buffered": args.scheme_buffered,
        "host_link_bytes_per_s": args.host_link_bytes_per_s,
        "workload": args.workload,
        "when_changed": args.scheme_when_changed,
        "window_quantile": args.scheme_window_quantile,
        "window_memory": args.scheme_window_memory,
        "state_bytes": state_bytes,
        "step_times_s": times,
        "clean_step_times_s": clean,
        "ckpt_steps": ckpt_steps,
        "baseline_step_s": base,
        "num_free_steps": len(free),
        "median_step_s": statistics.median(times),
        "mean_step_s": loop_s / len(times),
        "stall_per_ckpt_s": (sum(times) - len(times) * base) / len(ckpt_steps),
        "stall_windows_s": [
            sum(t - base for t in times[c : c + args.interval]) for c in ckpt_steps
        ],
        "own_efficiency": len(times) * base / sum(times),
        "first_save_extra_s": warmup[first_save_at] - base if scheme else 0.0,
        "drain_s": drain_s,
        "peak_rss_mb": peak_rss_mb,
        "loadavg": os.getloadavg(),
        "step_split": split,
        "timeline_text": timeline_text,
    }
    if scheme is not None:
        files = _files_under(last_path)
        bytes_on_disk = sum(os.path.getsize(f) for f in files)
        drop_page_cache(files)
        _, raw_read_s = read_raw(files)
        drop_page_cache(files)
        start = time.perf_counter()
        scheme.restore(last_path)
        restore_s = time.perf_counter() - start
        persist = scheme.persist_gbps or [bytes_on_disk / s / 1e9 for s in scheme.durable_s]
        result.update(
            fsync=scheme.fsync if scheme.fsync is not None else FSYNCS[args.scheme],
            durable_s=scheme.durable_s,
            persist_gbps=persist,
            bytes_on_disk=bytes_on_disk,
            raw_read_s=raw_read_s,
            restore_s=restore_s,
            engine_metrics=scheme.engine_metrics,
        )
    shutil.rmtree(ckpt_root, ignore_errors=True)
    return result


def _scheme_process(args: argparse.Namespace, result_path: str) -> None:
    Path(result_path).write_text(json.dumps(run_scheme(args)))


def config_tags(when_changed: bool, window_quantile: float | None,
                window_memory: int | None) -> str:
    """`` [frozen_copy=when_changed] [window_quantile Q] [window_memory M]``, the parts that
    apply: a row's GoCkptConfig options beside the defaults, in its names and labels."""
    return ((" [frozen_copy=when_changed]" if when_changed else "")
            + (f" [window_quantile {window_quantile:g}]" if window_quantile is not None else "")
            + (f" [window_memory {window_memory}]" if window_memory is not None else ""))


# ---------------------------------------------------------------- report (parent process)
def label(r: dict) -> str:
    name = r["scheme"]
    text = LABELS.get(name) or f"GoCkpt {name.removeprefix('gockpt-')}"
    if r.get("repeat"):
        text += " (repeat)"
    if r.get("io_nice") is not None:
        text += f" [io_nice {r['io_nice']}]"
    if r.get("buffered"):
        text += " [buffered writes]"
    if r["emulated"]:
        text += f" [emulated link {r['host_link_bytes_per_s'] / 1e9:.2g} GB/s]"
    if r.get("workload", "fp32") != "fp32":
        text += f" [{r['workload']}]"
    text += config_tags(r.get("when_changed", False), r.get("window_quantile"),
                        r.get("window_memory"))
    if r.get("forecast_round") is not None:
        text += f" (round {r['forecast_round'] + 1})"
    return text


def summarize(results: list[dict], raw: dict) -> list[dict]:
    """Adds the ratios against ``none`` and against the raw bandwidths to every row."""
    none_s = statistics.mean(r["mean_step_s"] for r in results if r["scheme"] == "none")
    for r in results:
        r["label"] = label(r)
        r["throughput_vs_none"] = none_s / r["mean_step_s"]
        if "durable_s" in r:
            r["durable_median_s"] = statistics.median(r["durable_s"])
            r["persist_vs_raw"] = statistics.median(r["persist_gbps"]) / raw["write_fsync_gbps"]
            r["restore_vs_raw"] = r["restore_s"] / r["raw_read_s"]
        if r.get("engine_metrics"):
            r.update(plan_stats(r))
    return results


def plan_stats(r: dict) -> dict:
    """Over a GoCkpt row's measured saves (its ``engine_metrics``): the plans chosen; means of
    the predicted stall and its lower bound, the engine-reported and the wall stall, seconds.
    Means, not medians: where saves share a snapshot, one copies (and predicts the copy) and
    the other copies nothing, and a median picks either."""
    ms = r["engine_metrics"]
    return {
        "predicted_stall_mean_s": statistics.mean(m["predicted_stall_s"] for m in ms),
        "lower_bound_mean_s": statistics.mean(m["stall_lower_bound_s"] for m in ms),
        "engine_stall_per_ckpt_s": statistics.mean(m["stall_s"] for m in ms),
        "wall_stall_mean_s": statistics.mean(r["stall_windows_s"]),
        # "shared": saves of one snapshot (a request that finished the windows of the save
        # before it and took its snapshot, and that save).
        "planned": sorted({f"{m['mode']} K={m['num_overlap_steps']}"
                           + (" shared" if m.get("host_shared") else "") for m in ms}),
    }


def _plan_summary(r: dict) -> str:
    """``; planned ..., predicted ... s (bound ... s), engine ... s``: one emulated row's line."""
    st = plan_stats(r)
    return (f"; planned {', '.join(st['planned'])}, predicted stall "
            f"{st['predicted_stall_mean_s']:.3f} s (lower bound {st['lower_bound_mean_s']:.3f} s), "
            f"engine-reported {st['engine_stall_per_ckpt_s']:.3f} s, wall "
            f"{st['wall_stall_mean_s']:.3f} s (means over the saves)")


def planner_rows(results: list[dict]) -> list[dict]:
    """The emulated-link GoCkpt rows with the planner's prediction next to what was measured."""
    return [r for r in results if r["emulated"] and r.get("engine_metrics")]


def _window_end_s(r: dict) -> float:
    """Mean over the row's saves of the stall waiting at window ends, seconds."""
    ms = r["engine_metrics"]
    return statistics.mean(m["stall_by_phase_s"].get("window_end", 0.0) for m in ms)


def forecast_lines(results: list[dict]) -> list[str]:
    """Per window forecast of the ``--window-quantile`` or ``--window-memory`` comparison (the
    emulated-link auto rows at two forecasts, run in alternation): the median over its rounds
    of the measured (engine) stall over the predicted one, of the measured stall itself, and
    of its part spent waiting at window ends (``stall_by_phase_s["window_end"]``, mean over
    the saves), in seconds."""
    from gockpt import GoCkptConfig

    rows = [r for r in planner_rows(results) if r.get("forecast_round") is not None]
    by_forecast: dict[tuple[float, int], list[dict]] = {}
    for r in rows:
        q = r["window_quantile"] if r.get("window_quantile") is not None else GoCkptConfig.window_quantile
        m = r["window_memory"] if r.get("window_memory") is not None else GoCkptConfig.window_memory
        by_forecast.setdefault((q, m), []).append(r)
    memories = {m for _, m in by_forecast}
    lines = []
    for (q, m), rs in sorted(by_forecast.items()):
        ratios = [r["engine_stall_per_ckpt_s"] / r["predicted_stall_mean_s"] for r in rs
                  if r["predicted_stall_mean_s"] > 1e-6]
        latest = f"latest {m} windows" if len(memories) > 1 else "latest windows"
        lines.append(
            f"window forecast: quantile {q:g} of the {latest}: measured / predicted stall "
            f"{statistics.median(ratios) if ratios else float('nan'):.2f} (median of {len(ratios)} "
            f"rounds; each: {', '.join(f'{x:.2f}' for x in ratios)}), measured stall "
            f"{statistics.median(r['engine_stall_per_ckpt_s'] for r in rs):.3f} s per checkpoint, "
            f"of which waits at window ends {statistics.median(_window_end_s(r) for r in rs):.4f} s")
    return lines


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}" if b > 1e-6 else "-"


def planner_table(results: list[dict]) -> list[str]:
    """Markdown: per emulated-link row, the plans chosen, the predicted stall and its lower
    bound and the measured stalls with their ratios (means over the measured saves:
    :func:`plan_stats`)."""
    rows = planner_rows(results)
    if not rows:
        return []
    lines = [
        "| scheme | plans | predicted stall (s) | lower bound (s) | engine-reported stall (s) "
        "| engine / predicted | wall stall / ckpt (s) | wall / predicted |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        pred, engine, wall = (r["predicted_stall_mean_s"], r["engine_stall_per_ckpt_s"],
                              r["wall_stall_mean_s"])
        lines.append(
            f"| {r['label']} | {', '.join(r['planned'])} | {pred:.3f} "
            f"| {r['lower_bound_mean_s']:.3f} | {engine:.3f} | {_ratio(engine, pred)} "
            f"| {wall:.3f} | {_ratio(wall, pred)} |"
        )
    return lines


def targets(results: list[dict]) -> list[str]:
    """The issue's targets next to the measured ratios (reported, not asserted)."""
    by = {(r["scheme"], r["emulated"]): r for r in results
          if r.get("io_nice") is None and not r.get("buffered")
          and r.get("window_quantile") is None and r.get("window_memory") is None
          and r.get("forecast_round") is None}
    floor = max(abs(r["stall_per_ckpt_s"]) for r in results if r["scheme"] == "none")
    lines = [f"noise floor (largest |stall| of the 'none' runs): {floor:.3f} s per checkpoint"]
    disk = by.get(("disk-only", False))
    if disk and disk["step_split"]["during_n"]:
        lines.append(
            f"disk floor (another process writes as many bytes, O_DIRECT + fsync, nothing copied): "
            f"stall {disk['stall_per_ckpt_s']:.3f} s per checkpoint, step during the write "
            f"{disk['step_split']['during_vs_free']:.3f} x a step without one")
    reference = by.get(("lightning-async", False))
    floor_scheme = by.get(("host-snapshot", False))
    if reference and floor_scheme:
        ratio = floor_scheme["stall_per_ckpt_s"] / reference["stall_per_ckpt_s"]
        lines.append(
            f"context: the reference host snapshot's stall is {ratio:.3f} x AsyncCheckpointIO's"
        )
    for name in ("gockpt-gockpt", "gockpt-gockpt_o", "gockpt-auto"):
        r = by.get((name, False))
        if r is None:
            continue
        if reference:
            ratio = r["stall_per_ckpt_s"] / reference["stall_per_ckpt_s"]
            lines.append(f"{r['label']}: stall {ratio:.3f} x AsyncCheckpointIO's (target <= 0.05)")
        lines.append(
            f"{r['label']}: throughput {r['throughput_vs_none']:.3f} x none, "
            f"{r['own_efficiency']:.3f} x its own clean-step rate (target >= 0.99)"
        )
        lines.append(
            f"{r['label']}: persist {r['persist_vs_raw']:.2f} x raw write+fsync (target >= 0.8)"
        )
        lines.append(f"{r['label']}: restore {r['restore_vs_raw']:.2f} x raw read (target <= 1.5)")
    for r in results:
        split = r["step_split"]
        if r["scheme"].startswith("gockpt-") and split["during_n"]:
            less = split.get("during_less_own_vs_free")
            less_text = ("" if less is None else
                         f"; less GoCkpt's own waits in those steps (window ends, gradient "
                         f"copies: {split['own_wait_during_mean_s'] * 1e3:.1f} ms per step) "
                         f"{less:.3f} x")
            lines.append(
                f"{r['label']}: step during a checkpoint {split['during_vs_free']:.3f} x a step "
                f"without one{less_text} (target: within the noise, here {split['noise']:.3f})")
    for r in planner_rows(results):
        pred = r["predicted_stall_mean_s"]
        lines.append(
            f"{r['label']}: measured stall {_ratio(r['engine_stall_per_ckpt_s'], pred)} x (engine) and "
            f"{_ratio(r['wall_stall_mean_s'], pred)} x (wall) the predicted {pred:.3f} s, lower "
            f"bound {r['lower_bound_mean_s']:.3f} s, means over the saves (target: within 1.2x)")
    lines += forecast_lines(results)
    lazy, overlap = by.get(("gockpt-lazy", True)), by.get(("gockpt-gockpt_o", True))
    if lazy and overlap:
        ratio = overlap["stall_per_ckpt_s"] / lazy["stall_per_ckpt_s"]
        lines.append(f"emulated link: gockpt_o stall {ratio:.3f} x lazy's (target <= 0.5)")
    return lines


def markdown(results: list[dict], raw: dict, meta: dict) -> str:
    """The table, the definitions and the targets, as the docs show them."""

    def cell(r: dict, key: str, fmt: str) -> str:
        return format(r[key], fmt) if key in r else "-"

    lines = [
        "| scheme | clean step (s) | step during a ckpt (s) | during / without "
        "| during, less own waits / without "
        "| stall / ckpt (s) | engine-reported stall (s) "
        "| throughput vs none | time to durable (s) | fsync | persist vs raw write+fsync "
        "| restore vs raw read | peak RSS (MB) | peak RSS above none (ckpts) "
        "| engine host buffers, peak (ckpts) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|:---:|---:|---:|---:|---:|---:|",
    ]
    none_rss = min(r["peak_rss_mb"] for r in results if r["scheme"] == "none")
    ckpt_mb = meta["state_bytes"] / 2**20
    for r in results:
        host = [m.get("host_peak_bytes", 0) for m in r.get("engine_metrics") or []]
        host_cell = f"{max(host) / meta['state_bytes']:.2f}" if any(host) else "-"
        fsync = {True: "yes", False: "no"}.get(r.get("fsync"), "-")
        split = r["step_split"]
        during = "-" if not split["during_n"] else f"{split['during_median_s']:.3f}"
        ratio = "-" if not split["during_n"] else f"{split['during_vs_free']:.3f}"
        less = ("-" if "during_less_own_vs_free" not in split or not r["scheme"].startswith("gockpt-")
                else f"{split['during_less_own_vs_free']:.3f}")
        lines.append(
            f"| {r['label']} | {r['baseline_step_s']:.3f} | {during} | {ratio} | {less} "
            f"| {r['stall_per_ckpt_s']:.3f} "
            f"| {cell(r, 'engine_stall_per_ckpt_s', '.3f')} | {r['throughput_vs_none']:.3f} | {cell(r, 'durable_median_s', '.2f')} | {fsync} "
            f"| {cell(r, 'persist_vs_raw', '.2f')} | {cell(r, 'restore_vs_raw', '.2f')} "
            f"| {r['peak_rss_mb']:.0f} | {(r['peak_rss_mb'] - none_rss) / ckpt_mb:.2f} | {host_cell} |"
        )
    return "\n".join(
        [
            "# Checkpoint cost benchmark",
            "",
            f"`python examples/benchmark.py {meta['argv']}` on {meta['machine']} (niceness "
            f"{meta['nice']}, 1-minute load average {meta['loadavg']} during the runs): preset "
            f"`{meta['preset']}`{meta['workload_text']} ({meta['state_bytes'] / 1e6:.0f} MB of weights "
            "and AdamW state), "
            f"{meta['steps']} measured steps, a checkpoint every {meta['interval']} steps, one "
            f"training thread (`torch.set_num_threads(1)`), each scheme in its own process; "
            f"total {meta['total_s']:.0f} s.",
            "",
            *lines,
            "",
            *(["Planner on the emulated link (means over the measured checkpoints: two saves "
               "that share a snapshot stall and predict differently, one copying and one not; "
               "wall stall: the extra step time of the steps from a checkpoint's request to the "
               "next, engine-reported: `CheckpointMetrics.stall_s`):", "", *planner, ""]
              if (planner := planner_table(results)) else []),
            f"Raw bandwidth of this machine, same run, {raw['bytes'] / 1e6:.0f} MB: memcpy "
            f"{raw['memcpy_gbps']:.2f} GB/s, write+fsync {raw['write_fsync_gbps']:.2f} GB/s, cold "
            f"read {raw['cold_read_gbps']:.2f} GB/s.",
            "",
            f"- {STALL_DEFINITION.format(clean=meta['clean_steps'])}.",
            "- Step during a checkpoint: median time of the measured steps that started while a "
            "checkpoint was in flight (after its request, before it was complete; the request's "
            "own step excluded); during / without: that over the median step with none in flight "
            "(the clean step), both from the same process. During, less own waits: the same "
            "steps less GoCkpt's own waits inside each (its `stall_s` gained during the step: "
            "window ends, gradient copies), so what is left is what the background work "
            "(copy, replay, persist) costs the steps.",
            "- Engine-reported stall: GoCkpt's own count of the training thread's waits per "
            "checkpoint (`CheckpointMetrics.stall_s`); the wall-clock stall also holds the slowdown "
            "of steps by the engine's background work.",
            "- Throughput: steps per second over the measured steps relative to the mean of the "
            "`none` runs (separate processes; `none (repeat)`, run last, shows the run-to-run noise).",
            "- Time to durable: median over checkpoints, from the request until complete; after "
            "fsync only where fsync is `yes`.",
            "- Persist: GoCkpt's persist phase; for the others the whole save, serialization "
            "included (nothing finer is observable from outside).",
            "- Restore: load into the live model and optimizer, against a raw read of the same files; "
            "page cache dropped before both (fsync + `posix_fadvise(POSIX_FADV_DONTNEED)`).",
            "- Peak RSS: `ru_maxrss` of the scheme's process after training, before the restore; "
            "above none: less the smallest 'none' row's, in checkpoint sizes (weights + optimizer state).",
            "- Engine host buffers, peak: the most bytes of snapshot slots and gradient buffers the "
            "engine held at once (`CheckpointMetrics.host_peak_bytes`), in checkpoint sizes.",
            "- Rows marked *emulated link* throttle GoCkpt's copy worker by sleeping, so that a full "
            "copy spans several steps as over a real device-to-host link; they are emulations, not "
            "measurements of a device.",
            "",
            "Targets from the issue, next to the measured ratios (reported, not asserted):",
            "",
            *[f"- {t}" for t in targets(results)],
            "",
            "![stall per checkpoint and relative throughput per scheme](benchmark.png)",
            "",
            "Step times during a checkpoint per scheme and, for GoCkpt, the timeline of one "
            "checkpoint (`gockpt._trace`; the one nearest the middle whose flight overlapped no "
            "other's, else the middle one): per thread and phase, seconds after the request of the "
            "first start and the last end, busy wall time, the thread's CPU time in the phase and "
            "between its phases (Python, holding the GIL), and for each phase the median time of "
            "the steps it covered for at least half of their time over the median step without a "
            "checkpoint.",
            "",
            "```text",
            *[r["timeline_text"] for r in results if r.get("timeline_text")],
            "```",
            "",
        ]
    )


def chart(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = results[::-1]
    names = [r["label"] for r in rows]
    colors = [
        "#bbbbbb"
        if r["scheme"] == "none"
        else "#d62728"
        if r["scheme"].startswith("gockpt")
        else "#1f77b4"
        for r in rows
    ]
    hatches = ["//" if r["emulated"] else "" for r in rows]
    fig, (left, right) = plt.subplots(1, 2, figsize=(13, 0.42 * len(rows) + 1.6), sharey=True)
    stalls = [max(r["stall_per_ckpt_s"], 1e-3) for r in rows]
    throughputs = [r["throughput_vs_none"] for r in rows]
    for ax, values, fmt in ((left, stalls, "{:.3f} s"), (right, throughputs, "{:.3f}")):
        for y, (v, c, h, r) in enumerate(zip(values, colors, hatches, rows, strict=True)):
            ax.barh(y, v, color=c, hatch=h, edgecolor="black", linewidth=0.4)
            shown = r["stall_per_ckpt_s"] if ax is left else v
            ax.text(v, y, " " + fmt.format(shown), va="center", fontsize=8)
    floor = max(abs(r["stall_per_ckpt_s"]) for r in rows if r["scheme"] == "none")
    if floor > 0:
        left.axvline(floor, color="gray", linestyle="--", linewidth=1, label="noise floor (none)")
        left.legend(loc="lower right", fontsize=8)
    left.set_xscale("log")
    left.set_xlabel("stall per checkpoint (s, log; floored at 1 ms)")
    right.set_xlabel("throughput relative to no checkpoint")
    left.set_xlim(1e-3, max(stalls) * 4)
    right.set_xlim(min(0.5, min(throughputs) - 0.02), max(1.1, max(throughputs) + 0.1))
    right.axvline(0.99, color="black", linestyle=":", linewidth=1)
    left.set_yticks(range(len(rows)), names)
    fig.suptitle("Checkpoint cost per scheme (hatched: emulated slow host link)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


#: docs/benchmark.md: what follows this line was measured in other runs (another machine, other
#: options) and survives --update-docs.
KEEP_MARKER = "<!-- measured in other runs; kept by benchmark.py --update-docs -->"


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add(
        "--out",
        default="bench_out",
        help="output folder (JSON, table, chart; temporary checkpoints)",
    )
    add("--data", default=None, help="text file or folder (default: pydoc_data)")
    add("--preset", default="bench", help="model size from examples/workload.py")
    add(
        "--workload",
        default="fp32",
        help="training set-up from examples/workload.py (WORKLOADS): fp32, bf16-autocast, "
        "bf16-master, lora",
    )
    add("--batch-size", type=int, default=None, help="default: the preset's")
    add("--steps", type=int, default=60, help="measured steps")
    add("--warmup", type=int, default=5, help="warm-up steps (one checkpoint among them)")
    add("--clean-steps", type=int, default=8, help="steps without checkpoints before and after")
    add("--interval", type=int, default=10, help="steps between checkpoints")
    add(
        "--schemes",
        default=",".join(SCHEMES),
        help="comma-separated subset of " + ",".join(SCHEMES),
    )
    add(
        "--host-link-gbps",
        default="auto",
        help="emulated host link for GoCkpt in GB/s; 'auto': a full copy spans --copy-steps "
        "steps; 0: no emulated rows",
    )
    add("--copy-steps", type=float, default=4.0)
    add(
        "--io-threads",
        type=int,
        default=None,
        help="GoCkptConfig.num_io_threads (default: its own)",
    )
    add(
        "--io-nice",
        type=int,
        default=None,
        help="also run the GoCkpt lazy and auto rows with GoCkptConfig.io_nice at this value, "
        "beside the rows at the default",
    )
    add(
        "--buffered",
        action="store_true",
        help="also run the GoCkpt lazy and gockpt_o rows with GoCkptConfig.direct_io=False "
        "(shard files through the page cache), beside the rows at the default (O_DIRECT)",
    )
    add("--when-changed", action="store_true",
        help="also run the GoCkpt lazy, gockpt_o and auto rows (emulated link too) with "
        "GoCkptConfig.frozen_copy='when_changed' (frozen parameters the host slot still holds are "
        "not copied again; workload lora), beside the rows at the default ('always')")
    add("--window-quantile", type=float, default=None,
        help="also run the emulated-link auto row with GoCkptConfig.window_quantile at this "
        "value and at 0.5 (the median), in alternation --forecast-rounds times, and report each "
        "forecast's measured / predicted stall (with --when-changed, both with "
        "frozen_copy='when_changed')")
    add("--window-memory", type=int, default=None,
        help="also run the emulated-link auto row with GoCkptConfig.window_memory at this value "
        "and at the default, in alternation --forecast-rounds times, both at --window-quantile "
        "(else the default), and report each forecast's measured / predicted stall")
    add("--forecast-rounds", type=int, default=3,
        help="rounds of the --window-quantile or --window-memory comparison (default 3)")
    add("--no-repeat", action="store_true", help="skip the second 'none' run (run-to-run noise)")
    add("--no-lightning", action="store_true",
        help="skip the section with Lightning's defaults (a Trainer and its default ModelCheckpoint "
             "per checkpoint I/O: examples/bench_lightning.py)")
    add(
        "--emulated-only",
        action="store_true",
        help="run only 'none', the emulated-link rows (the planner's predictions) and "
             "'disk-only' (the write's floor) where --schemes names it",
    )
    add(
        "--nice",
        type=int,
        default=0,
        help="niceness of the benchmark processes; a negative value (root only) keeps other work "
        "on a shared machine from distorting the timings",
    )
    add(
        "--quick", action="store_true", help="tiny model, few steps: a smoke run, not a measurement"
    )
    add(
        "--update-docs",
        action="store_true",
        help="copy the table and chart to docs/benchmark.md and docs/benchmark.png",
    )
    return parser


def main() -> None:
    parser = _parser()
    args = parser.parse_args()
    if args.quick:
        args.preset, args.steps, args.warmup, args.clean_steps, args.interval = "tiny", 20, 4, 4, 5
    if args.window_quantile is not None and not 0.0 <= args.window_quantile <= 1.0:
        parser.error(f"--window-quantile must be in [0, 1], got {args.window_quantile}")
    if args.window_memory is not None and args.window_memory < 1:
        parser.error(f"--window-memory must be at least 1, got {args.window_memory}")
    from gockpt import GoCkptConfig

    if args.window_memory == GoCkptConfig.window_memory:
        parser.error(f"--window-memory {args.window_memory} is the default: nothing to compare")
    if args.forecast_rounds < 1:
        parser.error(f"--forecast-rounds must be at least 1, got {args.forecast_rounds}")
    schemes = [s for s in args.schemes.split(",") if s]
    if unknown := set(schemes) - set(SCHEMES):
        parser.error(f"unknown schemes {sorted(unknown)}; choose from {SCHEMES}")
    from workload import WORKLOADS

    if args.workload not in WORKLOADS:
        parser.error(f"unknown workload {args.workload!r}; choose from {WORKLOADS}")
    if args.workload == "bf16-master" and (
        others := [s for s in schemes if s != "none" and not s.startswith("gockpt-")]
    ):
        # Their state dicts hold optimizer state, not the optimizer's own (master) parameters.
        parser.error(f"--workload bf16-master keeps fp32 master weights outside the model, which "
                     f"{', '.join(others)} would not save; pass --schemes with GoCkpt rows only")
    started = time.perf_counter()
    if args.nice:
        try:  # inherited by the scheme processes and all their threads
            os.setpriority(os.PRIO_PROCESS, 0, args.nice)
        except PermissionError:
            print(f"cannot set niceness {args.nice} (needs root); running at the default")
    # Imported once here so that each forked scheme process starts without the import time; the
    # parent runs no torch op before forking, so every scheme starts from the same clean state.
    import multiprocessing

    import torch  # noqa: F401
    import transformers.models.llama.modeling_llama  # noqa: F401

    fork = multiprocessing.get_context("fork")
    os.makedirs(args.out, exist_ok=True)
    args.ckpt_dir = tempfile.mkdtemp(prefix="ckpt-", dir=args.out)

    def run(scheme: str, link: float | None = None, io_nice: int | None = None,
            buffered: bool = False, when_changed: bool = False,
            window_quantile: float | None = None, window_memory: int | None = None) -> dict:
        result_path = os.path.join(args.ckpt_dir, "result.json")
        child_args = argparse.Namespace(
            **{**vars(args), "scheme": scheme, "host_link_bytes_per_s": link,
               "scheme_io_nice": io_nice, "scheme_buffered": buffered,
               "scheme_when_changed": when_changed, "scheme_window_quantile": window_quantile,
               "scheme_window_memory": window_memory}
        )
        process = fork.Process(target=_scheme_process, args=(child_args, result_path))
        process.start()
        process.join()
        if process.exitcode != 0:
            raise RuntimeError(f"scheme {scheme!r} failed (exit code {process.exitcode})")
        os.sync()  # keep one scheme's write-back out of the next scheme's steps
        r = json.loads(Path(result_path).read_text())
        print(
            f"{scheme}{' [emulated link]' if link else ''}"
            f"{f' [io_nice {io_nice}]' if io_nice is not None else ''}"
            f"{' [buffered]' if buffered else ''}"
            f"{config_tags(when_changed, window_quantile, window_memory)}"
            f": clean step "
            f"{r['baseline_step_s']:.3f} s, stall/ckpt {r['stall_per_ckpt_s']:.3f} s"
            + (_plan_summary(r) if link and r.get("engine_metrics") else ""),
            flush=True,
        )
        if r["timeline_text"]:
            print(r["timeline_text"], flush=True)
        return r

    try:
        results = [run("none")]
        raw = measure_raw(args.ckpt_dir, results[0]["state_bytes"])
        print(f"raw: {json.dumps(raw)}", flush=True)
        if not args.emulated_only:
            results += [run(s) for s in schemes if s != "none"]
        elif "disk-only" in schemes:
            # The write's own floor beside the emulated rows: the same bytes by another process.
            results.append(run("disk-only"))
        if args.io_nice is not None:
            results += [run(s, io_nice=args.io_nice) for s in ("gockpt-lazy", "gockpt-auto")
                        if s in schemes]
        if args.buffered:
            results += [run(s, buffered=True) for s in ("gockpt-lazy", "gockpt-gockpt_o")
                        if s in schemes]
        if args.host_link_gbps == "auto":
            link = results[0]["state_bytes"] / (args.copy_steps * results[0]["baseline_step_s"])
        else:
            link = float(args.host_link_gbps) * 1e9 or None
        changed = ("gockpt-lazy", "gockpt-gockpt_o", "gockpt-auto") if args.when_changed else ()
        if not args.emulated_only:
            results += [run(s, when_changed=True) for s in changed if s in schemes]
        if link:
            results += [run(s, link) for s in EMULATED_SCHEMES if s in schemes]
            results += [run(s, link, when_changed=True) for s in changed if s in schemes]
            if args.window_memory is not None:
                # The default memory and M, both at --window-quantile (else the default).
                arms = [(args.window_quantile, None), (args.window_quantile, args.window_memory)]
            else:
                # The median (the forecast before window_quantile existed) and Q.
                arms = [(0.5, None), (args.window_quantile, None)]
            if (args.window_quantile is not None or args.window_memory is not None) \
                    and "gockpt-auto" in schemes:
                # In alternation, so that a slow drift of a shared machine reaches both alike
                # (frozen_copy as --when-changed says).
                for k in range(args.forecast_rounds):
                    for q, m in arms:
                        results.append({**run("gockpt-auto", link, when_changed=args.when_changed,
                                              window_quantile=q, window_memory=m),
                                         "forecast_round": k})
        if not args.no_repeat:
            results.append({**run("none"), "repeat": True})
        lightning_results = []
        if not args.no_lightning and not args.emulated_only and args.workload == "fp32":
            import bench_lightning

            lightning_results = bench_lightning.run_all(args, fork, args.ckpt_dir)
    finally:
        shutil.rmtree(args.ckpt_dir, ignore_errors=True)

    summarize(results, raw)
    loads = [r["loadavg"][0] for r in results]
    meta = {
        "argv": " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU cores",
        "nice": os.getpriority(os.PRIO_PROCESS, 0),
        "preset": args.preset,
        "workload": args.workload,
        "workload_text": "" if args.workload == "fp32" else f", workload `{args.workload}`",
        "state_bytes": results[0]["state_bytes"],
        "steps": args.steps,
        "warmup": args.warmup,
        "clean_steps": args.clean_steps,
        "interval": args.interval,
        "total_s": time.perf_counter() - started,
        "stall_definition": STALL_DEFINITION.format(clean=args.clean_steps),
        "loadavg": f"{min(loads):.1f} to {max(loads):.1f}",
    }
    table = markdown(results, raw, meta)
    if lightning_results:
        import bench_lightning

        table += "\n" + bench_lightning.section(lightning_results, args.interval,
                                                 raw.get("write_fsync_gbps"))
    out = Path(args.out)
    report = {"meta": meta, "raw": raw, "results": results, "targets": targets(results),
              "lightning_defaults": lightning_results}
    (out / "benchmark.json").write_text(json.dumps(report, indent=1))
    (out / "benchmark.md").write_text(table)
    chart(results, str(out / "benchmark.png"))
    print(table)
    if args.update_docs:
        docs = Path(__file__).resolve().parents[1] / "docs"
        docs.mkdir(exist_ok=True)
        # Sections measured on other machines (the GPU table) follow KEEP_MARKER and are kept.
        target = docs / "benchmark.md"
        kept = target.read_text().partition(KEEP_MARKER)[2] if target.exists() else ""
        text = (out / "benchmark.md").read_text()
        target.write_text(text + (f"\n{KEEP_MARKER}{kept}" if kept else ""))
        shutil.copyfile(out / "benchmark.png", docs / "benchmark.png")


if __name__ == "__main__":
    main()
