"""Inference from a GoCkpt checkpoint directory: ``load_from_checkpoint`` for Lightning classes.

A ``*.ckpt`` written by ``GoCkptIO`` is a directory, which stock
``LightningModule.load_from_checkpoint`` cannot open. :func:`load_from_checkpoint` loads the
dict with :meth:`GoCkptIO.load_checkpoint` and hands it to the same steps the stock method
runs after its ``torch.load`` (legacy migration, ``hparams_file``, keyword overrides,
``on_load_checkpoint``, ``load_state_dict``). A plain file goes to the stock method unchanged.

For a Trainer, nothing new is needed: with the plugin, ``trainer.validate/test/predict(model,
ckpt_path=dir)`` load through the same ``GoCkptIO.load_checkpoint``.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, TypeVar, cast

import lightning.pytorch as pl
from lightning.pytorch.core.saving import (  # the stock method's own steps (Lightning 2.x)
    _load_state,
    _pl_migrate_checkpoint,
    load_hparams_from_tags_csv,
    load_hparams_from_yaml,
)

from gockpt import storage

from .convert import load_gockpt_lightning

__all__ = ["load_from_checkpoint"]

T = TypeVar("T", pl.LightningModule, pl.LightningDataModule)


def load_from_checkpoint(
    cls: type[T],
    checkpoint_path: str | os.PathLike,
    map_location: Any = None,
    hparams_file: str | os.PathLike | None = None,
    strict: bool | None = None,
    *,
    weights_only: bool | None = None,
    storage_options: Mapping[str, Any] | None = None,
    **kwargs: Any,
) -> T:
    """``cls.load_from_checkpoint`` that also opens GoCkpt checkpoint directories.

    Example::

        model = lightning_gockpt.load_from_checkpoint(MyModel, "ckpts/epoch=3-step=400.ckpt")
        model.eval()

    Args:
        cls: a ``LightningModule`` or ``LightningDataModule`` subclass.
        checkpoint_path: a GoCkpt checkpoint directory (local path or fsspec URL), or a file.
        map_location: a device or device string for the tensors (CPU when None).
        hparams_file: a ``.yaml``/``.csv`` file whose hyperparameters replace the stored ones.
        strict: passed to ``load_state_dict`` (None: the module's ``strict_loading``).
        weights_only: ``False`` unpickles arbitrary objects (trusted files only).
        storage_options: fsspec options for a URL.
        **kwargs: hyperparameters overriding the stored ones, as for the stock method.

    Returns:
        An instance of ``cls`` holding the checkpoint's state (a module in eval-ready form on the
        device of ``map_location``).

    Raises:
        FileNotFoundError: nothing complete at ``checkpoint_path``.
        gockpt.CheckpointCorruptError: a corrupt file (names it), or a directory not written by
            ``GoCkptIO``.
        ValueError: ``hparams_file`` is not ``.yaml``, ``.yml`` or ``.csv``.
    """
    path = os.fspath(checkpoint_path)
    hparams_path = None if hparams_file is None else str(os.fspath(hparams_file))
    fs, local = storage.url_to_fs(path, storage_options)
    if fs.isfile(local):
        return cls.load_from_checkpoint(path, map_location=map_location, hparams_file=hparams_path,
                                        strict=strict, weights_only=weights_only, **kwargs)
    checkpoint = load_gockpt_lightning(path, storage_options=storage_options,
                                       allow_pickle=weights_only is False, map_location=map_location)
    # From here on, what lightning.pytorch.core.saving._load_from_checkpoint does after torch.load.
    checkpoint = _pl_migrate_checkpoint(checkpoint, checkpoint_path=None)
    if hparams_path is not None:
        extension = hparams_path.rpartition(".")[2].lower()
        if extension == "csv":
            checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = load_hparams_from_tags_csv(hparams_path)
        elif extension in ("yml", "yaml"):
            checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY] = load_hparams_from_yaml(hparams_path)
        else:
            raise ValueError(".csv, .yml or .yaml is required for `hparams_file`")
    checkpoint.setdefault(cls.CHECKPOINT_HYPER_PARAMS_KEY, {})
    checkpoint[cls.CHECKPOINT_HYPER_PARAMS_KEY].update(kwargs)
    if issubclass(cls, pl.LightningDataModule):
        return cast(T, _load_state(cls, checkpoint, **kwargs))
    model = cast(pl.LightningModule, _load_state(cls, checkpoint, strict=strict, **kwargs))
    tensors = [t for t in checkpoint.get("state_dict", {}).values() if hasattr(t, "device")]
    return cast(T, model.to(tensors[0].device) if tensors else model)
