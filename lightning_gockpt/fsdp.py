"""``GoCkptIO`` under ``FSDPStrategy(state_dict_type="sharded")``: stock's DCP directory, written in the background.

Stock ``FSDPStrategy`` with sharded state dicts writes a ``torch.distributed.checkpoint``
directory on every rank (``dcp.save``, blocking) plus ``meta.pt`` (Lightning's dict without the
model and optimizer state) from global rank 0. Under GoCkpt the same directory is written by
``torch.distributed.checkpoint.async_save`` over a gloo group: the ranks' shards are staged to
host memory at the request (the stall) and written by DCP's background thread; the directory
is committed as every staged checkpoint is (:mod:`lightning_gockpt.staged`: a staging directory,
per-rank markers, one rename by rank 0), so the path never holds a partial directory. The
strategy loads it as its own (``fit(ckpt_path=...)``).

FSDP (version 1) keeps flat parameters that GoCkpt's engine does not track, so these checkpoints
take no multi-step overlap or replay: each is captured at its request (``lazy``).
"""

from __future__ import annotations

import os
import re
from concurrent.futures import Future
from typing import Any

import torch

from gockpt.fsutil import fsync_path

from .staged import StagedAdapterEngine


class _Writer:
    """The :data:`lightning_gockpt.staged.Writer` of a sharded ``FSDPStrategy``'s checkpoints.

    Makes a gloo group over every rank for DCP (collective: build it on every rank);
    :meth:`close` destroys it.
    """

    #: A sharded checkpoint directory as ``FSDPStrategy`` writes it (DCP's ``.metadata`` and
    #: ``.distcp`` files, Lightning's ``meta.pt``): a directory of only these is replaced by
    #: the next save of its path, as stock's would be.
    framework_names = re.compile(r"\.metadata|__\d+_\d+\.distcp|meta\.pt")

    def __init__(self, strategy: Any) -> None:
        import torch.distributed as dist

        self.strategy = strategy
        self.group = dist.new_group(backend="gloo")

    def __call__(self, stage: str, checkpoint: dict) -> tuple[Future[int], int]:
        import torch.distributed.checkpoint as dcp
        from lightning.fabric.strategies.fsdp import _METADATA_FILENAME

        rest = dict(checkpoint)
        converted = {"model": rest.pop("state_dict")}  # as stock FSDPStrategy.save_checkpoint
        converted.update({f"optimizer_{i}": s for i, s in enumerate(rest.pop("optimizer_states", []))})
        nbytes = _local_bytes(converted)
        uploaded = dcp.async_save(converted, checkpoint_id=stage, process_group=self.group)
        if self.strategy.global_rank == 0:  # Lightning's dict, small: written now, durable before the commit
            meta = os.path.join(stage, _METADATA_FILENAME)
            with open(meta, "wb") as f:
                torch.save(rest, f)
                f.flush()
                os.fsync(f.fileno())
        written: Future[int] = Future()

        def done(f: Future) -> None:
            try:
                f.result()
                fsync_path(stage)
            except BaseException as e:  # noqa: BLE001 - delivered through the future
                written.set_exception(e)
                return
            written.set_result(nbytes)

        uploaded.add_done_callback(done)
        return written, nbytes

    def close(self) -> None:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group(self.group)


def writer(strategy: Any) -> _Writer:
    """The :data:`lightning_gockpt.staged.Writer` of ``strategy``'s sharded checkpoints (has ``close``)."""
    return _Writer(strategy)


def _local_bytes(tree: Any) -> int:
    """Bytes of this rank's tensors in ``tree`` (local shards of sharded tensors)."""
    if isinstance(tree, dict):
        return sum(_local_bytes(v) for v in tree.values())
    if isinstance(tree, (list, tuple)):
        return sum(_local_bytes(v) for v in tree)
    if hasattr(tree, "local_shards"):  # ShardedTensor
        return sum(s.tensor.numel() * s.tensor.element_size() for s in tree.local_shards())
    if hasattr(tree, "to_local"):  # DTensor
        tree = tree.to_local()
    if isinstance(tree, torch.Tensor):
        return tree.numel() * tree.element_size()
    return 0


def build_engine(callback: Any, trainer: Any) -> StagedAdapterEngine:
    """The engine of ``callback`` over ``trainer``'s sharded FSDPStrategy (every rank; collective)."""
    assert callback.io is not None
    # One save in flight: DCP's background collectives of two saves on one group could
    # interleave differently on different ranks.
    return StagedAdapterEngine(trainer.strategy, callback.io.config, writer(trainer.strategy),
                               rank=trainer.global_rank, world=trainer.world_size,
                               collective=lambda: not callback._failed, max_inflight=1)  # noqa: SLF001


__all__ = ["build_engine", "writer"]
