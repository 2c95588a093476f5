"""Convert checkpoints between GoCkpt and the formats other tools read.

Sources (:func:`open_source` tells them apart):

- a GoCkpt checkpoint directory (it has ``manifest.json``), or a directory of them (the newest
  complete one is read, see :func:`gockpt.latest_checkpoint`); written by ``GoCkptIO`` it is read
  through the Lightning :class:`Framework` (``GoCkptIO.load_checkpoint``), so the dict is exactly
  the one a Trainer with the plugin resumes from;
- a single ``torch.save`` file: a stock Lightning ``.ckpt`` (or a bare state_dict);
- an Accelerate ``save_state`` folder (``model.safetensors`` / ``pytorch_model.bin``,
  ``optimizer.bin``, ``scheduler.bin``, ...).

Targets: ``hf`` (:func:`to_hf`: safetensors weights with a key prefix stripped, sharded with
Hugging Face's index layout), ``dcp`` (:func:`to_dcp`: a ``torch.distributed.checkpoint``
directory), ``gockpt`` (:func:`to_gockpt`), and ``lightning`` (one ``.ckpt`` file:
``get_framework("lightning").to_file``). Paths are local paths or fsspec URLs.
Every writer is the library's own: ``safetensors``, ``huggingface_hub``'s shard planner,
``torch.distributed.checkpoint.save``, GoCkpt's blocking save (:func:`gockpt.snapshot.save_tree`).

Frameworks: what needs a training framework's own code (Lightning's dict read from or saved as a
GoCkpt checkpoint, its single-file format) is a :class:`Framework` that the framework's adapter
package provides through the entry point group :data:`FRAMEWORKS_GROUP` (or
:func:`register_framework`). This engine package recognises such checkpoints from their data and
imports no adapter, so it works, and names what to install, where the framework is absent.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import pathlib
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from . import fsutil, storage
from .errors import CheckpointCorruptError
from .folder import SIDECAR_NAME
from .frameworks import (
    FRAMEWORKS_GROUP,
    Framework,
    FrameworkUnavailableError,
    get_framework,
    register_framework,
)
from .load import framework_files
from .manifest import is_part
from .format import FORMAT_NAME
from .restore import load_checkpoint
from .snapshot import own_copy, own_storage, save_tree

__all__ = [
    "FRAMEWORKS_GROUP",
    "LIGHTNING",
    "Framework",
    "FrameworkUnavailableError",
    "Source",
    "check_destination",
    "get_framework",
    "open_source",
    "own_storage",
    "register_framework",
    "to_dcp",
    "to_gockpt",
    "to_hf",
]

logger = logging.getLogger(__name__)

# Accelerate's save_state file names (accelerate.utils.constants), read without importing it.
_ACC_MODEL = re.compile(r"^(model|pytorch_model)(_\d+)?\.(safetensors|bin)$")
_ACC_OPTIMIZER = re.compile(r"^optimizer(_(\d+))?\.bin$")
_ACC_RNG = re.compile(r"^random_states_\d+\.pkl$")

#: Lightning's :class:`Framework` name, also the ``extra`` key under which ``GoCkptIO`` keeps
#: Lightning's dict. Its checkpoints (that key, or a ``torch.save`` dict with
#: ``pytorch-lightning_version``) are recognised from the data, without importing Lightning, so
#: where it is missing the error names it instead of the checkpoint being misread.
LIGHTNING = "lightning"


@dataclass
class Source:
    """A checkpoint opened for conversion; every tensor on the CPU.

    Attributes:
        path: the checkpoint read (a ``latest`` pointer resolved).
        kind: ``"gockpt-lightning"`` (written by ``GoCkptIO``, also by the ranks of a DDP
            run sharing the write), ``"gockpt"`` (by :class:`gockpt.Engine`),
            ``"gockpt-sharded"`` (one part per rank, :mod:`gockpt.sharded`, assembled by
            :func:`gockpt.dcp.load_full`), ``"torch-file"`` (a ``torch.save`` file such as a
            stock Lightning ``.ckpt``) or ``"accelerate"`` (a ``save_state`` folder).
        model_state_dict: the model's tensors by ``state_dict()`` key.
        state: everything the checkpoint holds, as nested dicts and lists (Lightning's dict
            for Lightning checkpoints; ``{"model", "optimizers", "extra"}`` otherwise).
        step: the optimizer step the checkpoint holds (``global_step`` for Lightning).
        lightning: Lightning's checkpoint dict when the source is one, else None.
        notes: what was left out, for the user (files that need ``allow_pickle``).
    """

    path: str
    kind: str
    model_state_dict: dict[str, torch.Tensor]
    state: dict[str, Any]
    step: int
    lightning: dict[str, Any] | None = None
    notes: list[str] = field(default_factory=list)


def open_source(
    path: str, *, storage_options: Mapping[str, Any] | None = None, allow_pickle: bool = False
) -> Source:
    """Open the checkpoint at ``path`` (see the module docstring for the kinds recognised).

    Args:
        path: local path or fsspec URL.
        storage_options: fsspec options.
        allow_pickle: unpickle arbitrary objects (trusted files only); by default only
            tensors, containers and primitives load.

    Returns:
        A :class:`Source`.

    Raises:
        FileNotFoundError: nothing at ``path``, or a directory holding no checkpoint.
        gockpt.CheckpointCorruptError: a corrupt GoCkpt checkpoint, a file ``torch.load``
            cannot read (empty, cut short, not a zip archive), or a file of an Accelerate
            folder that is not a regular file (a FIFO, device or symlink: refused, never read)
            or a ``model.safetensors`` that does not decode (names the file).
        FrameworkUnavailableError: a ``GoCkptIO`` checkpoint where the Lightning framework is
            not registered or does not import (the ``lightning`` extra is missing).
        pickle.UnpicklingError: a file that needs ``allow_pickle``.
        ValueError: ``path`` is one rank's part of a sharded checkpoint (``rank-<r>/``).
    """
    options = dict(storage_options or {})
    fs, root = storage.url_to_fs(path, options)
    if not fs.exists(root):
        raise FileNotFoundError(f"{path}: no such file or directory")
    if fs.isfile(root):
        with fs.open(root, "rb") as f:
            try:
                obj = torch.load(f, map_location="cpu", weights_only=not allow_pickle)
            except (RuntimeError, EOFError) as e:  # cut short, empty, not a zip archive
                what = str(e).splitlines()[0] if str(e) else "it ends before its first record"
                raise CheckpointCorruptError(f"{path}: not a readable torch.save file: {what}") from e
        return _torch_file_source(path, obj)
    if not storage.is_complete(path, options) and not storage.has_manifest(path, options):
        newest = storage.latest_checkpoint(path, options)
        if newest is not None:
            logger.info("gockpt: %s: using %s, the newest complete checkpoint there", path, newest)
            path = newest
        elif any(_ACC_MODEL.match(_base(p)) for p in fs.ls(root, detail=False)):
            return _accelerate_source(path, fs, root, allow_pickle)
        else:
            raise FileNotFoundError(
                f"{path}: not a checkpoint (no manifest.json, no complete checkpoint inside, "
                "no Accelerate model file)")
    fs, root = storage.url_to_fs(path, options)
    manifest = storage.read_manifest(fs, root)  # a damaged manifest: the error names it
    if manifest["meta"].get("sharded") is not None:
        return _sharded_source(path, manifest["meta"]["sharded"], allow_pickle)
    if is_part(manifest):  # one rank's share: converted alone, a model of partial tensors
        raise ValueError(f"{path} is one rank's part of a sharded checkpoint, not a checkpoint on "
                         "its own: convert the sharded checkpoint directory that holds it")
    if framework_files(manifest) and any(_ACC_MODEL.match(n) for n in manifest["files"]):
        # A framework's own folder layout written by the engine (accelerate_gockpt): its files
        # checked against the manifest, then read as the framework's folder.
        from .audit import require_intact

        require_intact(path, options)
        return _accelerate_source(path, fs, root, allow_pickle, skip=_WRITER_FILES)
    state = load_checkpoint(path, storage_options=options, allow_pickle=allow_pickle)
    step = int(state.manifest["meta"].get("captured_step", 0))
    if isinstance(state.extra, dict) and LIGHTNING in state.extra:
        # Verified above; the dict comes from the very code a resuming Trainer runs.
        return _lightning_source(path, options, allow_pickle, verify=False, step=step)
    everything = {"model": state.model_state_dict, "optimizers": state.optimizer_state_dicts,
                  "extra": state.extra}
    return Source(path, "gockpt", _tensors(state.model_state_dict), everything, step)


def to_hf(
    source: Source,
    dst: str,
    *,
    prefix: str = "",
    max_shard_size: int | str = "5GB",
    storage_options: Mapping[str, Any] | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[str]:
    """Write the model's weights as Hugging Face safetensors in the directory ``dst``.

    One ``model.safetensors``, or ``model-0000i-of-0000n.safetensors`` files plus
    ``model.safetensors.index.json`` when the weights exceed ``max_shard_size`` (planned by
    ``huggingface_hub.split_torch_state_dict_into_shards``). Tied weights are written under
    every name. Files carry the metadata ``{"format": "pt"}`` that ``transformers`` expects.

    Args:
        source: from :func:`open_source`.
        dst: output directory (local path or fsspec URL).
        prefix: only keys starting with it are written, with it removed (``"model."`` turns
            Lightning's ``model.embed_tokens.weight`` into ``embed_tokens.weight``).
        max_shard_size: bytes per file, an int or a string such as ``"5GB"``.
        storage_options: fsspec options.
        progress: called with the bytes of each file written.

    Returns:
        The names of the files written, the index last.

    Raises:
        ValueError: no key starts with ``prefix``.
        ModuleNotFoundError: ``huggingface_hub`` is not installed (``pip install gockpt[hf]``).
    """
    import json

    import safetensors.torch
    from huggingface_hub import split_torch_state_dict_into_shards

    check_destination(source, dst, storage_options)
    weights = {k[len(prefix):]: t for k, t in source.model_state_dict.items() if k.startswith(prefix)}
    if not weights:
        some = ", ".join(sorted(source.model_state_dict)[:3])
        raise ValueError(f"no model key starts with {prefix!r} (keys look like: {some})")
    # Own storage per tensor and per name: tensors loaded from one GoCkpt shard are views of
    # one memory map, which the shard planner would keep in one file, and safetensors refuses
    # tensors that share memory (tied weights are written under each name).
    weights = {k: own_copy(t) for k, t in weights.items()}
    split = split_torch_state_dict_into_shards(weights, max_shard_size=max_shard_size)
    fs, root = storage.url_to_fs(dst, storage_options)
    made = storage.is_local(fs) and not os.path.lexists(root)
    fs.makedirs(root, exist_ok=True)
    written = []
    try:
        for name, keys in split.filename_to_tensors.items():
            shard = {k: weights[k] for k in keys}
            data = safetensors.torch.save(shard, metadata={"format": "pt"})
            write_file(fs, fsutil.join(root, name), functools.partial(_write_all, data=data))
            written.append(name)
            if progress is not None:
                progress(len(data))
        if split.is_sharded:
            index = {"metadata": {**split.metadata, "gockpt_source": source.path, "step": source.step},
                     "weight_map": split.tensor_to_filename}
            text = json.dumps(index, indent=2, sort_keys=True).encode()
            write_file(fs, fsutil.join(root, "model.safetensors.index.json"),
                       functools.partial(_write_all, data=text))
            written.append("model.safetensors.index.json")
    except BaseException:
        if made:  # the directory this call made, with what it wrote there
            with contextlib.suppress(OSError):
                fsutil.remove_local(root)
        raise
    return written


def to_dcp(source: Source, dst: str, *, storage_options: Mapping[str, Any] | None = None) -> None:
    """Write everything the checkpoint holds as a ``torch.distributed.checkpoint`` directory.

    ``dcp.load(state_dict, checkpoint_id=dst)`` then fills any subset of it, on any number of
    ranks (resharding is DCP's), and
    ``torch.distributed.checkpoint.format_utils.dcp_to_torch_save`` turns it into one file.
    Non-tensor values are stored pickled by DCP; DCP turns integer dict keys (optimizer
    state indices) into strings.

    Args:
        source: from :func:`open_source`.
        dst: output directory (local path or fsspec URL).
        storage_options: fsspec options (URLs only).

    A local ``dst`` must not exist or be an empty directory: DCP writes its files into a
    staging directory beside it, which is renamed to ``dst`` once complete (a failed write
    leaves nothing, and no file already at ``dst``, or a symlink there, is written through).

    Raises:
        ValueError: ``dst`` exists and is not an empty directory, or would change a checkpoint
            (:func:`check_destination`).
        gockpt.CheckpointStorageError: DCP's write failed (a full disk, a read-only target);
            names ``dst``, the original error as ``__cause__``.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    check_destination(source, dst, storage_options)
    no_dist = not (dist.is_available() and dist.is_initialized())
    if "://" in dst:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(dst, **dict(storage_options or {}))
        _dcp_save(dcp, source.state, dst, storage_writer=writer, no_dist=no_dist)
        return
    final = os.path.abspath(dst)
    if os.path.lexists(final) and not (os.path.isdir(final) and not os.path.islink(final)
                                       and not os.listdir(final)):
        raise ValueError(f"{dst} exists and is not an empty directory; --to dcp writes a new one")
    parent = os.path.dirname(final)
    os.makedirs(parent, exist_ok=True)
    staging = fsutil.scratch_path(parent, os.path.basename(final))
    os.mkdir(staging)
    try:
        _dcp_save(dcp, source.state, dst, checkpoint_id=staging, no_dist=no_dist)
        os.replace(staging, final)  # over an empty directory too (POSIX rename)
    finally:
        with contextlib.suppress(OSError):
            fsutil.remove_local(staging)


def _dcp_save(dcp: Any, state: Any, dst: str, **kwargs: Any) -> None:
    """``dcp.save``, its wrapped failure raised as a storage error naming ``dst``."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.save(state, **kwargs)
    except CheckpointException as e:
        failures = [f[0] if isinstance(f, tuple) else f for f in e.failures.values()]
        first = failures[0] if failures else e
        raise fsutil.storage_error(first, dst, None, action="converting to") from e


def to_gockpt(
    source: Source,
    dst: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 1 << 30,
) -> None:
    """Write ``source`` as a GoCkpt checkpoint directory.

    A Lightning ``.ckpt`` is saved by ``GoCkptIO.save_checkpoint`` itself (its blocking path
    outside ``fit``), so ``Trainer(plugins=[GoCkptIO()]).fit(model, ckpt_path=dst)`` resumes
    from it as from the original file. An Accelerate folder becomes an engine checkpoint
    (:func:`gockpt.snapshot.save_tree`): model, optimizers, and the folder's other files under
    ``extra["accelerate"]``, for :meth:`gockpt.Engine.restore` / :func:`gockpt.load_checkpoint`.

    Raises:
        ValueError: the source is already a GoCkpt checkpoint, or a ``torch.save`` file that is
            not a Lightning checkpoint.
        FrameworkUnavailableError: a Lightning ``.ckpt`` where the Lightning framework is not
            registered or does not import.
    """
    if source.kind.startswith("gockpt"):
        raise ValueError(f"{source.path} is already a GoCkpt checkpoint (copy the directory)")
    check_destination(source, dst, storage_options)
    if source.kind == "torch-file":
        if source.lightning is None:
            raise ValueError(f"{source.path}: not a Lightning checkpoint (no 'state_dict' and "
                             "'pytorch-lightning_version'); convert a state_dict with --to hf")
        lightning = get_framework(LIGHTNING, needed_for=f"{source.path}: a Lightning checkpoint")
        lightning.save_gockpt(source.lightning, dst, storage_options=storage_options,
                              max_shard_bytes=max_shard_bytes)
        return
    save_tree(dst, {"accelerate": source.state["extra"]}, model=source.model_state_dict,
              optimizers=source.state["optimizers"], step=source.step,
              storage_options=storage_options, max_shard_bytes=max_shard_bytes,
              # Its run is not known: it orders before any recorded run's checkpoints.
              meta={"converted_from": source.path, "run": 0})


def check_destination(source: Source | str, dst: str,
                      storage_options: Mapping[str, Any] | None = None) -> None:
    """Refuse an output path whose write would change a checkpoint.

    Refused: the source itself or a path inside it, and a path that is, or lies inside, a
    GoCkpt checkpoint (a directory holding a GoCkpt ``manifest.json``, complete or not; one
    that does not decode counts as GoCkpt's, another program's JSON does not): a file written
    there would replace or add to the checkpoint's files. Locally the paths are compared
    after symlinks are resolved.

    Args:
        source: the :class:`Source` converted (or its path).
        dst: the output path (local path or fsspec URL).
        storage_options: fsspec options.

    Raises:
        ValueError: ``dst`` is one of those; names both paths.
    """
    src_path = source.path if isinstance(source, Source) else source
    fs, out = storage.url_to_fs(dst, storage_options)
    sfs, src = storage.url_to_fs(src_path, storage_options)
    if storage.is_local(fs):
        out = os.path.realpath(out)
        src = os.path.realpath(src) if storage.is_local(sfs) else None
        parents = [out, *(str(p) for p in pathlib.PurePath(out).parents)]
    else:
        out = out.rstrip("/")
        src = src.rstrip("/") if type(sfs) is type(fs) else None
        parts = out.split("/")
        parents = ["/".join(parts[:i]) for i in range(len(parts), 0, -1)]
    sep = os.sep if storage.is_local(fs) else "/"
    if src is not None and (out == src or out.startswith(src.rstrip(sep) + sep)):
        raise ValueError(f"{dst} is {'' if out == src else 'inside '}the source {src_path}: "
                         "converting there would change it; write somewhere else")
    for directory in parents:
        if _holds_gockpt_manifest(fs, directory):
            raise ValueError(
                f"{dst} is {'' if directory == out else 'inside '}the GoCkpt checkpoint "
                f"{directory}: converting there would change its files; write somewhere else")


def _holds_gockpt_manifest(fs: Any, directory: str) -> bool:
    """Whether ``directory`` holds a ``manifest.json`` that is GoCkpt's or may be (damaged:
    unreadable, not a JSON object)."""
    import json

    target = fsutil.join(directory, storage.MANIFEST_NAME)
    if not (os.path.lexists(target) if storage.is_local(fs) else fs.exists(target)):
        return False
    try:
        obj = json.loads(storage.read_bounded(fs, target, max_bytes=storage.MAX_METADATA_BYTES))
    except Exception:  # noqa: BLE001 - unreadable or not JSON: may be a damaged checkpoint's
        return True
    return not isinstance(obj, dict) or obj.get("format") == FORMAT_NAME


# --- sources -----------------------------------------------------------------------------


def _sharded_source(path: str, sharded: Mapping[str, Any], allow_pickle: bool) -> Source:
    """A sharded checkpoint (local): a DDP run's written by ``GoCkptIO`` becomes Lightning's
    dict (its parts joined by ``GoCkptIO.load_checkpoint``); any other is assembled by
    :func:`gockpt.dcp.load_full` (model, optimizer state by parameter name, rank 0's extra)."""
    from .dcp import load_full
    from .sharded import part_name

    if sharded.get("replicated"):
        head = load_checkpoint(fsutil.join_user(path, part_name(0)), allow_pickle=allow_pickle)
        if isinstance(head.extra, dict) and LIGHTNING in head.extra:
            return _lightning_source(path, None, allow_pickle, verify=True, step=head.captured_step)
    full = load_full(path, allow_pickle=allow_pickle)
    everything = {"model": full.model_state_dict, "optimizer_state": full.optimizer_state,
                  "param_groups": full.param_groups, "extra": full.extra}
    return Source(path, "gockpt-sharded", dict(full.model_state_dict), everything, full.captured_step)


def _lightning_source(path: str, options: Mapping[str, Any] | None, allow_pickle: bool, *,
                      verify: bool, step: int) -> Source:
    """A checkpoint ``GoCkptIO`` wrote (one directory, or the parts of a DDP run's) as
    Lightning's dict, read by the Lightning framework's own load path."""
    lightning = get_framework(LIGHTNING, needed_for=f"{path}: a Lightning checkpoint").load_gockpt(
        path, storage_options=options, allow_pickle=allow_pickle, verify=verify)
    return Source(path, "gockpt-lightning", _tensors(lightning.get("state_dict", {})),
                  lightning, int(lightning.get("global_step", step)), lightning)


def _torch_file_source(path: str, obj: Any) -> Source:
    if not isinstance(obj, dict):
        raise ValueError(f"{path}: holds a {type(obj).__name__}, not a checkpoint dict")
    if isinstance(obj.get("state_dict"), dict):
        lightning = obj if "pytorch-lightning_version" in obj else None
        return Source(path, "torch-file", _tensors(obj["state_dict"]), obj,
                      int(obj.get("global_step", 0)), lightning)
    if obj and all(isinstance(v, torch.Tensor) for v in obj.values()):  # a bare state_dict
        return Source(path, "torch-file", dict(obj), {"model": obj}, 0)
    raise ValueError(f"{path}: a dict without 'state_dict' and not a state_dict of tensors")


#: Files the engine adds to a framework's folder layout (:mod:`gockpt.folder`): not the framework's.
_WRITER_FILES = frozenset({storage.MANIFEST_NAME, SIDECAR_NAME})


def _accelerate_source(path: str, fs: Any, root: str, allow_pickle: bool,
                       skip: frozenset[str] = frozenset()) -> Source:
    """An Accelerate ``save_state`` folder; every file is read through :func:`_read_file`
    (``skip``: names that are not Accelerate's).

    Raises:
        ValueError: more than one model file.
        gockpt.CheckpointCorruptError: a file that is not a regular file (a FIFO, device or
            symlink), or a ``model.safetensors`` that does not decode (names the file).
        pickle.UnpicklingError: a file that needs ``allow_pickle``.
    """
    import safetensors.torch

    names = sorted(n for n in (_base(p) for p in fs.ls(root, detail=False)) if n not in skip)
    models = [n for n in names if _ACC_MODEL.match(n)]
    if len(models) > 1:
        raise ValueError(f"{path}: {len(models)} model files ({models}); GoCkpt converts one model")
    model_path = fsutil.join(root, models[0])
    raw = _read_file(fs, model_path)
    if models[0].endswith(".safetensors"):
        try:
            model = safetensors.torch.load(raw)
        except Exception as e:
            raise CheckpointCorruptError(
                f"{model_path}: not a safetensors file ({type(e).__name__}: {e})", path=model_path
            ) from e
    else:
        model = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    optimizers: dict[int, Any] = {}
    extra: dict[str, Any] = {}
    notes = []
    for name in names:
        if name in models or fs.isdir(fsutil.join(root, name)):
            continue
        if _ACC_RNG.match(name) and not allow_pickle:
            notes.append(f"{name}: RNG states (numpy objects) left out; --allow-pickle keeps them")
            continue
        blob = _read_file(fs, fsutil.join(root, name))
        try:
            obj = torch.load(io.BytesIO(blob), map_location="cpu", weights_only=not allow_pickle)
        except Exception as e:  # noqa: BLE001 - reported, the rest converts
            notes.append(f"{name}: left out ({type(e).__name__}: {str(e).splitlines()[0]})")
            continue
        m = _ACC_OPTIMIZER.match(name)
        if m:
            optimizers[int(m.group(2) or 0)] = obj
        else:
            extra[name.rpartition(".")[0]] = obj
    opt_list = [optimizers[i] for i in sorted(optimizers)]
    step = max((int(s["step"]) for sd in opt_list for s in sd.get("state", {}).values()
                if isinstance(s, dict) and "step" in s), default=0)
    state = {"model": model, "optimizers": opt_list, "extra": extra}
    return Source(path, "accelerate", model, state, step, None, notes)


def _read_file(fs: Any, file_path: str) -> bytes:
    """The whole file ``file_path`` of a folder that is not trusted, its size bounded before it
    is read: locally only a regular file that is not a symlink is opened (a FIFO or device is
    refused, never read) and no more than its size is read; remotely no more than the size the
    store reports.

    Raises:
        gockpt.CheckpointCorruptError: not a regular file, or its size unknown or changing
            while it is read (names the file).
    """
    if storage.is_local(fs):
        fd, size = storage.open_local_regular(file_path)
        os.close(fd)
    else:
        size = fs.size(file_path)
        if not isinstance(size, int) or size < 0:
            raise CheckpointCorruptError(f"{file_path}: the store reports no size for it",
                                         path=file_path)
    return storage.read_bounded(fs, file_path, max_bytes=size, exact_bytes=size)


def _write_all(f: Any, *, data: bytes) -> None:
    f.write(data)


def _tensors(sd: Mapping[str, Any]) -> dict[str, torch.Tensor]:
    return {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}


def _base(p: str) -> str:
    return p.rstrip("/").rpartition("/")[2]


def write_file(fs: Any, path: str, fill: Callable[[Any], Any]) -> None:
    """Create the file ``path`` and have ``fill(f)`` write it (``f.write``, ``torch.save``).

    Locally through a scratch name and an atomic rename, so a reader never sees half a file;
    on an object store the upload completes when the file closes.

    Raises:
        gockpt.CheckpointStorageError: the write failed (a full disk, a read-only target,
            a store error); names ``path``, the original error as ``__cause__``.
    """
    try:
        if not storage.is_local(fs):
            with fs.open(path, "wb") as f:
                fill(f)
            return
        parent, name = os.path.split(path)
        # A scratch name gockpt.storage.cleanup_staging removes should this process die here.
        tmp = fsutil.scratch_path(parent, name)
        try:
            with open(tmp, "wb") as f:
                fill(f)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.unlink(tmp)
    except OSError as e:
        raise fsutil.storage_error(e, path, path, action="converting to") from e
