"""Lightning checkpoints in and out of GoCkpt, through ``GoCkptIO``'s own load and save paths.

- :func:`load_gockpt_lightning`: a GoCkpt checkpoint directory written by ``GoCkptIO`` ->
  Lightning's checkpoint dict, by :meth:`GoCkptIO.load_checkpoint` (the dict a Trainer with the
  plugin resumes from).
- :func:`to_lightning_file`: that dict -> one ``.ckpt`` file (``torch.save``), which stock
  ``LightningModule.load_from_checkpoint``, ``torch.load`` and a Trainer without the plugin read.
- :func:`save_gockpt_lightning`: a stock ``.ckpt``'s dict -> a GoCkpt checkpoint, as
  :meth:`GoCkptIO.save_checkpoint` writes it outside ``fit`` (its blocking path), so
  ``Trainer(plugins=[GoCkptIO()]).fit(model, ckpt_path=...)`` resumes from it.

They reach ``gockpt convert`` (:mod:`gockpt.cli`) and :func:`gockpt.convert.open_source` as
:data:`FRAMEWORK`, registered under the entry point group ``gockpt.frameworks``
(``pyproject.toml``): the engine package looks them up by name and never imports this one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from gockpt import storage
from gockpt.convert import LIGHTNING, Framework, Source, check_destination, own_storage, write_file
from gockpt.snapshot import save_tree

from .io import GoCkptIO

__all__ = ["FRAMEWORK", "load_gockpt_lightning", "save_gockpt_lightning", "to_lightning_file"]


def load_gockpt_lightning(
    path: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    allow_pickle: bool = False,
    verify: bool = True,
    map_location: Any = None,
) -> dict[str, Any]:
    """Lightning's checkpoint dict of the GoCkpt checkpoint at ``path``.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
        allow_pickle: unpickle arbitrary objects (trusted files only).
        verify: check sizes and checksums of every file.
        map_location: a device for the tensors (CPU when None).

    Returns:
        What :meth:`GoCkptIO.load_checkpoint` returns.

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        gockpt.CheckpointCorruptError: a corrupt file, or a checkpoint not written by GoCkptIO.
    """
    io = GoCkptIO(storage_options=dict(storage_options or {}), verify_on_load=verify,
                  allow_pickle=allow_pickle)
    return io.load_checkpoint(path, map_location=map_location,
                              weights_only=False if allow_pickle else None)


def to_lightning_file(
    source: Source, dst: str, *, storage_options: Mapping[str, Any] | None = None
) -> int:
    """Write a Lightning-written GoCkpt checkpoint as one ``torch.save`` ``.ckpt`` file.

    Args:
        source: from :func:`gockpt.convert.open_source`, of kind ``"gockpt-lightning"``.
        dst: the file to write (local path or fsspec URL); local writes are atomic.
        storage_options: fsspec options.

    Returns:
        The file's size in bytes.

    Raises:
        ValueError: the source is not a GoCkpt checkpoint written by ``GoCkptIO``, or ``dst``
            would change a checkpoint (:func:`gockpt.convert.check_destination`).
        gockpt.CheckpointStorageError: the write failed (names ``dst``).
    """
    if source.kind == "gockpt-sharded":
        raise ValueError(
            f"{source.path}: a sharded checkpoint of sharded tensors (ModelParallelStrategy, "
            "FSDP2): it has no one-process Lightning dict for --to lightning; resume it under "
            "its strategy (any number of processes), or convert it --to hf or --to dcp")
    if source.kind != "gockpt-lightning" or source.lightning is None:
        raise ValueError(
            f"{source.path}: not a GoCkpt checkpoint written by GoCkptIO (a {source.kind} "
            "checkpoint); --to lightning needs one")
    check_destination(source, dst, storage_options)
    fs, path = storage.url_to_fs(dst, storage_options)
    parent = path.rpartition("/")[0]
    if parent:
        fs.makedirs(parent, exist_ok=True)
    # torch.save refuses views of one memory map; strides kept: the file holds what
    # GoCkptIO.load_checkpoint returns (a transposed buffer stays transposed).
    checkpoint = own_storage(source.lightning, keep_strides=True)
    write_file(fs, path, lambda f: torch.save(checkpoint, f))
    return int(fs.size(path))


def save_gockpt_lightning(
    checkpoint: dict[str, Any],
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Save Lightning's checkpoint dict (e.g. a stock ``.ckpt`` loaded) as a GoCkpt checkpoint.

    Args:
        checkpoint: Lightning's checkpoint dict.
        dst: checkpoint directory (local path or fsspec URL).
        storage_options: fsspec options.
        max_shard_bytes: tensor bytes per shard file.
    """
    # Its run is not known: it orders before any recorded run's checkpoints (as gockpt convert's).
    save_tree(dst, {"lightning": checkpoint}, step=int(checkpoint.get("global_step", 0)),
              storage_options=dict(storage_options or {}), max_shard_bytes=max_shard_bytes,
              update_latest=False, meta={"run": 0})


#: Lightning's :class:`gockpt.convert.Framework`: the entry point ``lightning`` of the group
#: ``gockpt.frameworks`` names it.
FRAMEWORK = Framework(LIGHTNING, load_gockpt=load_gockpt_lightning,
                      save_gockpt=save_gockpt_lightning, to_file=to_lightning_file)
