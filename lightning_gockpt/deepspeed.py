"""``GoCkptIO`` under Lightning's ``DeepSpeedStrategy``: DeepSpeed's own files, written in the background.

DeepSpeed writes its checkpoints itself, bypassing CheckpointIO: per checkpoint directory
``<path>/checkpoint/mp_rank_00_model_states.pt`` (data-parallel rank 0: the module and
Lightning's dict as ``client_state``), one ``zero_pp_rank_<r>_mp_rank_00_optim_states.pt`` per
rank (its ZeRO partition of the fp32 master weights and optimizer state), ``latest`` and
DeepSpeed's recovery scripts. Every file goes through DeepSpeed's checkpoint-engine seam
(``deepspeed.runtime.checkpoint_engine.CheckpointEngine``), where GoCkpt takes it.

The ZeRO optimizer keeps flat fp32 partitions that GoCkpt's engine does not track, so these
checkpoints take no multi-step overlap or replay: each is a ``lazy`` one captured at its
request (GoCkpt's fallback for optimizers it cannot replay; issue 13). What GoCkpt adds is the
write in the background and a commit that never leaves a torn checkpoint.

Call sequence of one checkpoint (every rank, the same step, ``Trainer.save_checkpoint``):

1. (training thread) the strategy's ``save_checkpoint`` (installed by
   :func:`lightning_gockpt.sharded.install`) requests the save through the callback; global
   rank 0 makes a staging directory beside the checkpoint path (locked, named so that
   :func:`gockpt.storage.cleanup_staging` knows it) and broadcasts it; stock
   ``DeepSpeedStrategy.save_checkpoint`` then runs with the staging directory as its path. Each
   file DeepSpeed saves reaches :class:`HostCopyEngine`, which copies the state dict's tensors
   into host memory (the stall; a device-to-host copy for GPU tensors) and queues the file.
2. (writer thread, every rank) each file is serialized with its tensor bytes copied outside
   the GIL (:func:`gockpt.torchfile.torch_file`), written and fsynced; then the rank's marker.
3. (commit thread, global rank 0) waits at most ``commit_timeout_s`` for every rank's marker,
   fsyncs and renames the staging directory into place (an atomic exchange where the kernel has
   it: :class:`gockpt.targets.LocalTarget`). A rank that fails or dies leaves no checkpoint at
   the path, and the previous one there is untouched.

Loading is stock's: DeepSpeed reads its own files (``fit(ckpt_path=...)``).
"""

from __future__ import annotations

import copy
import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

import gockpt
from gockpt import CheckpointMetrics, GoCkptConfig
from gockpt._sharded_commit import await_part, part_name, write_atomic
from gockpt.fsutil import fsync_path, is_local, scratch_path, split, url_to_fs
from gockpt.snapshot import map_tree
from gockpt.storage import claim_directory, cleanup_staging
from gockpt.targets import LocalTarget
from gockpt.torchfile import torch_file

log = logging.getLogger("lightning_gockpt")

COMMIT_TIMEOUT_S = 300.0  # seconds rank 0 waits for the other ranks' files once its own are written


def _host_copy(tree: Any) -> tuple[Any, int]:
    """A copy of ``tree`` whose tensors are host tensors with storages of their own.

    Tensors are copied (device-to-host for GPU tensors); other leaves are deep-copied, since
    DeepSpeed passes live objects (its loss scaler) that change after the call.

    Returns:
        The copy and its tensor bytes.
    """
    nbytes = 0

    def leaf(x: Any) -> Any:
        nonlocal nbytes
        if isinstance(x, torch.Tensor):
            nbytes += x.numel() * x.element_size()
            return x.detach().to("cpu", copy=True)
        return copy.deepcopy(x)

    return map_tree(tree, leaf, is_leaf=lambda x: isinstance(x, torch.Tensor)), nbytes


class HostCopyEngine:
    """DeepSpeed's checkpoint engine while GoCkpt saves: host copy now, file in the background.

    Duck-types ``deepspeed.runtime.checkpoint_engine.CheckpointEngine`` (DeepSpeed calls
    ``create``, ``makedirs``, ``save``, ``commit`` and ``load``), so the deepspeed package is not
    imported here. :meth:`save` is only valid between :meth:`begin` and :meth:`end`: a save
    outside GoCkpt's request raises, instead of writing a file nobody commits.
    """

    name = "GoCkptHostCopyEngine"

    def __init__(self) -> None:
        self._files: list[tuple[str, Any]] | None = None
        self.state_bytes = 0

    # --- GoCkpt's side
    def begin(self) -> None:
        self._files, self.state_bytes = [], 0

    def end(self) -> list[tuple[str, Any]]:
        files, self._files = self._files or [], None
        return files

    # --- DeepSpeed's side
    def create(self, info: Any) -> None:
        pass

    def makedirs(self, path: str, exist_ok: bool = False) -> None:
        os.makedirs(path, exist_ok=exist_ok)

    def save(self, state_dict: Any, path: str) -> None:
        if self._files is None:
            raise RuntimeError("GoCkpt's DeepSpeed checkpoint engine saves only inside a GoCkpt request")
        tree, nbytes = _host_copy(state_dict)
        self.state_bytes += nbytes
        self._files.append((path, tree))

    def load(self, path: str, map_location: Any = None) -> Any:
        return torch.load(path, map_location=map_location, weights_only=False)

    def commit(self, info: Any) -> bool:
        return True  # GoCkpt commits once every rank's files are durable (see the module doc)

    def is_data_parallel_writer(self, dp_rank: int) -> bool:
        return dp_rank == 0

    def is_decoupled(self) -> bool:
        return False

    def set_commit_info(self, info: Any) -> None:
        pass

    def get_commit_info(self) -> None:
        return None

    def cleanup(self) -> None:
        pass

    def preserves_storage_sharing(self) -> bool:
        # Each tensor is copied into a storage of its own: DeepSpeed need not clone them first.
        return False


class DeepSpeedHandle:
    """One DeepSpeed checkpoint in flight; the interface the callback uses (as a SaveHandle)."""

    skipped = False

    def __init__(self, path: str, future: Future[CheckpointMetrics]) -> None:
        self.path = path
        self._future = future

    def done(self) -> bool:
        return self._future.done()

    def add_done_callback(self, fn: Callable[[DeepSpeedHandle], None]) -> None:
        self._future.add_done_callback(lambda _f: fn(self))

    def result(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """The save's metrics once durable (committed, on global rank 0).

        Raises:
            TimeoutError: not finished within ``timeout_s`` seconds.
            The save's own error (a failed write, a missing rank: ``TimeoutError``).
        """
        return self._future.result(timeout_s)


class DeepSpeedAdapterEngine:
    """The engine interface :class:`~lightning_gockpt.GoCkptCallback` drives under DeepSpeed.

    Args:
        strategy: the ``DeepSpeedStrategy`` (its stock ``save_checkpoint`` writes the files).
        config: engine options (``max_inflight``: saves held in host memory per rank at once;
            ``storage_options`` must name a local filesystem).
        rank: this process's global rank; ``world``: the number of processes.
        collective: whether the ranks still meet (False once this rank's run failed).

    Raises:
        ValueError: a checkpoint path that is not local (checked per save).
    """

    def __init__(self, strategy: Any, config: GoCkptConfig, *, rank: int, world: int,
                 collective: Callable[[], bool]) -> None:
        self.strategy = strategy
        self.config = config
        self.rank, self.world = rank, world
        self._collective = collective
        self.version = 0  # optimizer updates seen (for the callback's bookkeeping)
        self._ds_engine = HostCopyEngine()
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="gockpt-ds-write")
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="gockpt-ds-commit") if rank == 0 else None
        self._handles: list[DeepSpeedHandle] = []
        self._latest: dict[str, DeepSpeedHandle] = {}
        self._lock = threading.Lock()
        self._claimed: set[str] = set()
        self._claims: list[Any] = []

    # --- the step hooks (nothing is tracked between saves)
    def before_update(self) -> None:
        pass

    def step_end(self) -> None:
        self.version += 1

    def flush(self) -> None:
        pass

    def save(self, path: str, *, state_fn: Callable[[], Any], max_overlap_steps: int | None = None,
             mode: str | None = None) -> DeepSpeedHandle:
        """Save DeepSpeed's checkpoint of this step at ``path`` in the background; collective.

        Returns after DeepSpeed's files are copied into host memory (``max_overlap_steps`` and
        ``mode`` are ignored: captured at the request).

        Raises:
            ValueError: ``path`` is not local.
            RuntimeError: the request failed on another rank (every rank raises).
            What DeepSpeed's save raises.
        """
        t0 = time.perf_counter()
        fs, root = url_to_fs(path, self.config.storage_options)
        if not is_local(fs):
            raise ValueError(f"DeepSpeed checkpoints are written to local paths only, got {path}")
        self._bound_inflight()
        parent, name = split(root)
        target, problem = None, None
        if self.rank == 0:
            try:
                if parent not in self._claimed:
                    os.makedirs(parent, exist_ok=True)
                    self._claims.append(claim_directory(parent, self.config.storage_options,
                                                        timeout_s=self.config.storage_timeout_s))
                    cleanup_staging(parent, self.config.storage_options)
                    self._claimed.add(parent)
                stage = scratch_path(parent, name)
                os.mkdir(stage)
                target = LocalTarget(fs, root, staging=stage)
            except BaseException as e:  # noqa: BLE001 - every rank must reach the broadcast
                problem = f"{type(e).__name__}: {e}"
        stage, problem = self.strategy.broadcast((target.staging if target else None, problem))
        if problem is not None:
            raise RuntimeError(f"gockpt: DeepSpeed checkpoint {path} not taken: {problem}")
        checkpoint = state_fn()["lightning"]
        engine = self.strategy.deepspeed_engine
        original = engine.checkpoint_engine
        engine.checkpoint_engine = self._ds_engine
        self._ds_engine.begin()
        try:
            self.strategy._gockpt_base.save_checkpoint(self.strategy, checkpoint, stage)  # noqa: SLF001
        except BaseException:
            self._ds_engine.end()
            if target is not None:
                target.cleanup(False)
            raise
        finally:
            engine.checkpoint_engine = original
        files = self._ds_engine.end()
        stall = time.perf_counter() - t0
        metrics = CheckpointMetrics(path=root, mode="lazy", num_overlap_steps=1, requested_step=self.version,
                                    captured_step=self.version, stall_s=stall, stall_by_phase_s={"copy": stall},
                                    state_bytes=self._ds_engine.state_bytes, host_bytes=self._ds_engine.state_bytes)
        written: Future[CheckpointMetrics] = self._writer.submit(self._write, stage, files, metrics, t0)
        future = written
        if self._commits is not None:
            assert target is not None
            future = self._commits.submit(self._commit, target, written, t0)
        handle = DeepSpeedHandle(root, future)
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()] + [handle]
            self._latest[root] = handle
        return handle

    def _bound_inflight(self) -> None:
        # Each save in flight holds its own host copy: at most max_inflight of them per rank.
        with self._lock:
            pending = [h for h in self._handles if not h.done()]
        while len(pending) >= max(1, self.config.max_inflight):
            try:
                pending[0].result()
            except BaseException:  # noqa: BLE001 - raised by wait(); here only room is awaited
                pass
            pending = pending[1:]

    def _write(self, stage: str, files: list[tuple[str, Any]], metrics: CheckpointMetrics,
               t0: float) -> CheckpointMetrics:
        # Writer thread: DeepSpeed's files into the staging directory, fsynced, then the marker.
        marker = os.path.join(stage, f"{part_name(self.rank)}.failed")
        try:
            start = time.perf_counter()
            nbytes, dirs = 0, {stage}
            for path, tree in files:
                data = torch_file(tree)
                os.makedirs(os.path.dirname(path), exist_ok=True)
                with open(path, "wb") as f:
                    f.write(data)
                    f.flush()
                    os.fsync(f.fileno())
                nbytes += len(data)
                dirs.add(os.path.dirname(path))
            for d in sorted(dirs, key=len, reverse=True):
                fsync_path(d)
            marker = os.path.join(stage, f"{part_name(self.rank)}.done")
            metrics.persist_bytes = nbytes
            metrics.persist_s = time.perf_counter() - start
            metrics.persist_gbps = nbytes / metrics.persist_s / 1e9 if metrics.persist_s > 0 else 0.0
            metrics.time_to_durable_s = time.perf_counter() - t0
            return metrics
        finally:
            if os.path.isdir(stage):
                try:
                    write_atomic(marker, b"")
                except OSError as e:  # the staging directory was removed by an abort
                    log.info("gockpt: could not mark %s: %s", stage, e)

    def _commit(self, target: LocalTarget, written: Future[CheckpointMetrics], t0: float) -> CheckpointMetrics:
        # Rank 0's commit thread: every rank's files durable, then one atomic rename.
        published = False
        try:
            metrics = written.result()
            deadline = time.monotonic() + COMMIT_TIMEOUT_S
            for r in range(self.world):
                await_part(target.staging, r, deadline)
            for r in range(self.world):
                os.unlink(os.path.join(target.staging, f"{part_name(r)}.done"))
            fsync_path(target.staging)
            target.publish(b"")
            published = True
            metrics.time_to_durable_s = time.perf_counter() - t0
            return metrics
        finally:
            target.cleanup(published)
            if not published:
                log.warning("gockpt: DeepSpeed checkpoint %s not committed", target.root)

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending save of this rank (rank 0: committed); raises the first error."""
        with self._lock:
            handles = list(self._handles)
        out = [h.result(timeout_s) for h in handles]
        with self._lock:
            self._handles = [h for h in self._handles if not h.done()]
        if self._collective():
            self.strategy.barrier("gockpt_deepspeed_wait")
        return out

    def remove(self, path: str) -> None:
        """Delete the checkpoint at ``path`` (rank 0); a save of it in flight first commits."""
        with self._lock:
            handle = self._latest.get(path)
        if handle is None or handle.done():
            gockpt.remove_checkpoint(path, self.config.storage_options, timeout_s=self.config.storage_timeout_s)
            return

        def drop(h: DeepSpeedHandle) -> None:
            with self._lock:
                if self._latest.get(path) is not h:
                    return  # saved again since: that save is the checkpoint now
            gockpt.remove_checkpoint(path, self.config.storage_options, timeout_s=self.config.storage_timeout_s)

        handle.add_done_callback(drop)

    def close(self) -> None:
        """Finish the pending saves and stop (collective while the ranks meet)."""
        try:
            self.wait()
        finally:
            self._writer.shutdown(wait=True)
            if self._commits is not None:
                self._commits.shutdown(wait=True)
            for c in self._claims:
                c.release()
            self._claims = []


def build_engine(callback: Any, trainer: Any) -> DeepSpeedAdapterEngine:
    """The engine of ``callback`` over ``trainer``'s DeepSpeed strategy (every rank)."""
    assert callback.io is not None
    return DeepSpeedAdapterEngine(trainer.strategy, callback.io.config, rank=trainer.global_rank,
                                  world=trainer.world_size, collective=lambda: not callback._failed)  # noqa: SLF001


__all__ = ["DeepSpeedAdapterEngine", "DeepSpeedHandle", "HostCopyEngine", "build_engine"]
