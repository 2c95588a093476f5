"""Entry point of the group ``lightning.pytorch.callbacks_factory``.

Lightning calls every factory of this group while a ``Trainer`` is being constructed, after its
plugins and strategy are set up and before the run starts (and before ``fit(ckpt_path="last")``
looks for ``last*.ckpt``). A factory takes no arguments, so the Trainer is found on the call
stack; Trainers without a ``GoCkptIO`` get nothing, and nothing is logged for them.
"""

from __future__ import annotations

import sys
from typing import Any


def callbacks_factory() -> list:
    """The callback half of :class:`lightning_gockpt.GoCkptIO` for a Trainer that uses it.

    Also clears, in the folders of the Trainer's ModelCheckpoints, the placeholders and scratch
    files that a run killed before its checkpoints were durable left (so that
    ``ckpt_path="last"`` finds the newest complete checkpoint, or, like stock Lightning, none;
    an empty ``last*.ckpt`` beside a complete checkpoint is left for that lookup to find, and
    removed once the run has resumed),
    and those of hpc saves in ``default_root_dir`` (so that a requeued SLURM job resumes from
    the newest complete ``hpc_ckpt_<n>.ckpt``).

    Returns:
        ``[GoCkptCallback()]`` when the Trainer under construction has a ``GoCkptIO`` (and no
        ``GoCkptCallback`` of its own), else ``[]``. When no Trainer is found on the stack, an
        inert callback (it links itself in ``setup`` only if the plugin is there).
    """
    trainer = _trainer_under_construction()
    if trainer is None:
        from .callback import GoCkptCallback

        return [GoCkptCallback(_from_factory=True)]
    io = _checkpoint_io(trainer)
    if io is None:
        return []
    from lightning.pytorch.callbacks import ModelCheckpoint

    from gockpt.storage import cleanup_staging

    from .callback import GoCkptCallback
    from .io import tidy_hpc, tidy_placeholders

    for cb in getattr(trainer, "callbacks", []):
        if isinstance(cb, ModelCheckpoint) and getattr(cb, "dirpath", None):
            cleanup_staging(str(cb.dirpath), io.config.storage_options)
            tidy_placeholders(str(cb.dirpath), io.config.storage_options, before_resume=True,
                              last_names={cb.CHECKPOINT_NAME_LAST, ModelCheckpoint.CHECKPOINT_NAME_LAST})
    if getattr(trainer, "_default_root_dir", None):  # set before the callbacks (Trainer.__init__)
        tidy_hpc(str(trainer.default_root_dir), io.config.storage_options)
    if any(isinstance(cb, GoCkptCallback) for cb in getattr(trainer, "callbacks", [])):
        return []
    return [GoCkptCallback(_from_factory=True)]


def _trainer_under_construction() -> Any:
    from lightning.pytorch import Trainer

    frame: Any = sys._getframe(1)
    for _ in range(12):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if isinstance(candidate, Trainer) and hasattr(candidate, "_accelerator_connector"):
            return candidate
        trainer = getattr(candidate, "trainer", None)
        if isinstance(trainer, Trainer) and hasattr(trainer, "_accelerator_connector"):
            return trainer
        frame = frame.f_back
    return None


def _checkpoint_io(trainer: Any) -> Any:
    from .io import GoCkptIO

    strategy = trainer._accelerator_connector.strategy
    io = getattr(strategy, "_checkpoint_io", None)
    io = getattr(io, "checkpoint_io", io)  # inside a wrapping CheckpointIO
    return io if isinstance(io, GoCkptIO) else None
