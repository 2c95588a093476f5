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
   rank 0 makes a staging directory beside the checkpoint path and broadcasts it; stock
   ``DeepSpeedStrategy.save_checkpoint`` then runs with the staging directory as its path. Each
   file DeepSpeed saves reaches :class:`HostCopyEngine`, which copies the state dict's tensors
   into host memory (the stall; a device-to-host copy for GPU tensors) and queues the file.
2. (writer thread, every rank) each file is serialized with its tensor bytes copied outside
   the GIL (:func:`gockpt.torchfile.torch_file`), written and fsynced.
3. The directory is committed as every staged checkpoint is (:mod:`lightning_gockpt.staged`:
   per-rank markers, then one rename by global rank 0), so a rank that fails or dies leaves no
   checkpoint at the path, and the previous one there is untouched.

Loading is stock's: DeepSpeed reads its own files (``fit(ckpt_path=...)``).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from gockpt.fsutil import fsync_path
from gockpt.snapshot import host_copy
from gockpt.torchfile import torch_file

from .staged import StagedAdapterEngine


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
        tree, nbytes = host_copy(state_dict)
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


class _Writer:
    """The :data:`lightning_gockpt.staged.Writer` of a DeepSpeed strategy's files.

    Runs stock ``DeepSpeedStrategy.save_checkpoint`` into the staging directory with
    :class:`HostCopyEngine` as DeepSpeed's checkpoint engine (the host copy is the stall), then
    writes the files on a thread of its own.
    """

    #: A DeepSpeed checkpoint directory as Lightning's strategy writes it (tag ``checkpoint``):
    #: a directory of only these is replaced by the next save of its path, as stock's would be.
    framework_names = re.compile(r"checkpoint|latest|zero_to_fp32\.py")

    def __init__(self, strategy: Any) -> None:
        self.strategy = strategy
        self.host = HostCopyEngine()
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="gockpt-ds-write")

    def __call__(self, stage: str, checkpoint: dict) -> tuple[Future[int], int]:
        strategy = self.strategy
        engine = strategy.deepspeed_engine
        original = engine.checkpoint_engine
        engine.checkpoint_engine = self.host
        self.host.begin()
        try:
            strategy._gockpt_base.save_checkpoint(strategy, checkpoint, stage)  # noqa: SLF001
        finally:
            engine.checkpoint_engine = original
            files = self.host.end()
        return self.pool.submit(_write_files, stage, files), self.host.state_bytes

    def close(self) -> None:
        self.pool.shutdown(wait=True)


def writer(strategy: Any) -> _Writer:
    """The :data:`lightning_gockpt.staged.Writer` of ``strategy``'s DeepSpeed files (has ``close``)."""
    return _Writer(strategy)


def _write_files(stage: str, files: list[tuple[str, Any]]) -> int:
    """Writer thread: DeepSpeed's files into the staging directory, each fsynced, then the directories."""
    nbytes, dirs = 0, {stage}
    for path, tree in files:
        data = torch_file(tree)  # the tensors' bytes are copied outside the GIL
        # DeepSpeed made the directories; one that is gone was removed by an abort, and is not
        # made again (it would outlive the save).
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        nbytes += len(data)
        dirs.add(os.path.dirname(path))
    for d in sorted(dirs, key=len, reverse=True):
        fsync_path(d)
    return nbytes


def build_engine(callback: Any, trainer: Any) -> StagedAdapterEngine:
    """The engine of ``callback`` over ``trainer``'s DeepSpeed strategy (every rank)."""
    assert callback.io is not None
    return StagedAdapterEngine(trainer.strategy, callback.io.config, writer(trainer.strategy),
                               rank=trainer.global_rank, world=trainer.world_size,
                               collective=lambda: not callback._failed)  # noqa: SLF001


__all__ = ["HostCopyEngine", "build_engine", "writer"]
