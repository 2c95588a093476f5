"""Loading sharded GoCkpt checkpoints through ``torch.distributed.checkpoint`` (DCP).

A sharded checkpoint (:mod:`gockpt.sharded`) holds one part per saving rank: that rank's local
shards in GoCkpt's safetensors shards, with ``rank-<r>.sharding.json`` giving each tensor's DCP key,
global shape and offsets. :class:`GoCkptStorageReader` is a DCP ``StorageReader`` over that
layout: its metadata lists every stored shard as a chunk of its global tensor, so ``dcp.load``
with any number of ranks and any ``DTensor`` placements plans the reads (DCP's
``DefaultLoadPlanner`` intersects the requested and the stored chunks: the resharding is
DCP's). Keys are the ones DCP flattens ``{"model": get_model_state_dict(model), "optim":
get_optimizer_state_dict(model, optimizers)}`` to: ``model.<fqn>`` and
``optim.state.<fqn>.<name>``. The parts of a replicated run's checkpoint (DDP ranks sharing the
write, ``ShardedEngine(..., replicated=True)``) hold disjoint whole tensors: each is one chunk at
offsets 0, read from the part of the rank that stored it. Parameter groups and the non-tensor state are not DCP tensors:
:func:`load_sharded` and :func:`load_full` take them from a part's own non-tensor state.
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import xxhash
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

from . import fsutil, storage
from .errors import CheckpointCorruptError
from .sharded import INDEX_FILE, part_name, sharding_name

__all__ = ["GoCkptStorageReader", "FullState", "load_full", "load_parts", "load_sharded"]


@dataclass(frozen=True)
class _Stored:
    file: str  # absolute path of the safetensors shard
    key: str  # the tensor's name in it (a GoCkpt layout key)


def _index(path: str) -> dict:
    """The global manifest's index (``sharded.json``) of the sharded checkpoint ``path``."""
    fs, root = fsutil.url_to_fs(path, None)
    try:
        manifest = storage.read_manifest(fs, root)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{path} is not a complete GoCkpt checkpoint (no manifest.json)") from None
    if "sharded" not in manifest["meta"]:
        raise ValueError(f"{path} is not a sharded GoCkpt checkpoint; use gockpt.load_checkpoint")
    raw = open(os.path.join(root, INDEX_FILE), "rb").read()
    if xxhash.xxh3_64(raw).hexdigest() != manifest["files"][INDEX_FILE]["xxh3_64"]:
        raise CheckpointCorruptError(f"{path}/{INDEX_FILE}: checksum mismatch", path=path)
    return json.loads(raw)


class GoCkptStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a sharded GoCkpt checkpoint directory.

    Args:
        path: the checkpoint directory (local path).
        verify: check each part's manifest against the index and every file's size and
            xxh3-64 checksum against its part's manifest before reading.

    Raises (from :meth:`read_metadata`):
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: ``path`` is not a sharded checkpoint.
        CheckpointCorruptError: a part or file that does not match its checksum.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        super().__init__()
        self.path = str(path)
        self.verify = verify
        self.storage_data: dict[MetadataIndex, _Stored] = {}

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self.storage_data = {}

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(checkpoint_id, INDEX_FILE))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        index = _index(self.path)
        md: dict[str, TensorStorageMetadata] = {}
        data: dict[MetadataIndex, _Stored] = {}
        for part in index["parts"]:
            root = os.path.join(self.path, part["name"])
            raw = open(os.path.join(root, storage.MANIFEST_NAME), "rb").read()
            if self.verify and xxhash.xxh3_64(raw).hexdigest() != part["manifest_xxh3_64"]:
                raise CheckpointCorruptError(f"{root}/manifest.json: checksum mismatch", path=self.path)
            manifest = storage.read_manifest(fsutil.url_to_fs(root, None)[0], root)
            if self.verify:
                _verify_files(root, manifest)
            sharding = json.loads(open(os.path.join(self.path, sharding_name(index["parts"].index(part))), "rb").read())
            for key, info in sharding["tensors"].items():
                if info["replica"] != 0:
                    continue  # the same chunk is read from the part that holds replica 0
                entry = manifest["tensors"][key]
                stored = _Stored(os.path.join(root, entry["file"]), key)
                names = [info["fqn"]] + [a for a, t in sharding["aliases"].items() if t == info["fqn"]]
                for fqn in names:
                    tmd = md.get(fqn)
                    if tmd is None:
                        tmd = md[fqn] = TensorStorageMetadata(
                            TensorProperties(dtype=getattr(torch, info["dtype"])),
                            torch.Size(info["global_shape"]), [])
                    tmd.chunks.append(ChunkStorageMetadata(torch.Size(info["offsets"]),
                                                           torch.Size(entry["shape"])))
                    data[MetadataIndex(fqn, info["offsets"])] = stored
        self.storage_data = data
        return Metadata(state_dict_metadata=md, storage_data=data)  # type: ignore[arg-type]

    def set_up_storage_reader(self, metadata: Metadata, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data = metadata.storage_data  # type: ignore[assignment]

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        from safetensors import safe_open

        per_file: dict[str, list] = {}
        for item in plan.items:
            per_file.setdefault(self.storage_data[item.storage_index].file, []).append(item)
        for file, items in per_file.items():
            with safe_open(file, framework="pt") as f:
                for req in items:
                    stored = self.storage_data[req.storage_index]
                    if req.type.name == "BYTE_IO":
                        raise ValueError(f"{self.path}: {req.dest_index.fqn} is not a tensor here")
                    sl = f.get_slice(stored.key)
                    idx = tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths, strict=True))
                    src = sl[idx] if idx else f.get_tensor(stored.key)
                    dst = planner.resolve_tensor(req).detach()
                    if dst.size() != src.size():
                        raise CheckpointCorruptError(
                            f"{file}: {stored.key} read as {list(src.shape)}, wanted {list(dst.shape)}",
                            path=self.path)
                    dst.copy_(src)
                    planner.commit_tensor(req, dst)
        fut: Future[None] = Future()
        fut.set_result(None)  # read synchronously above
        return fut


def _verify_files(root: str, manifest: dict) -> None:
    for name, entry in manifest["files"].items():
        h, n = xxhash.xxh3_64(), 0
        with open(os.path.join(root, name), "rb") as f:
            while chunk := f.read(8 << 20):
                h.update(chunk)
                n += len(chunk)
        if n != entry["bytes"] or h.hexdigest() != entry["xxh3_64"]:
            raise CheckpointCorruptError(f"{root}/{name}: size or checksum mismatch", path=root)


@dataclass
class FullState:
    """A sharded checkpoint assembled into whole tensors (one process).

    Attributes:
        model_state_dict: ``<fqn>`` -> full CPU tensor (the keys of ``model.state_dict()``).
        optimizer_state: ``<parameter fqn>`` -> {state name -> full CPU tensor}.
        param_groups: each optimizer's ``param_groups`` at the captured step (``params`` are
            parameter indices, as in ``optimizer.state_dict()``).
        extra: what rank 0's ``state_fn`` returned at the captured step.
        captured_step: optimizer updates applied to the stored state.
    """

    model_state_dict: dict[str, torch.Tensor]
    optimizer_state: dict[str, dict[str, torch.Tensor]]
    param_groups: list[list[dict[str, Any]]]
    extra: Any
    captured_step: int


def _part_state(path: str, rank: int, allow_pickle: bool) -> Any:
    from .restore import load_checkpoint

    return load_checkpoint(os.path.join(path, part_name(rank)), allow_pickle=allow_pickle)


def load_parts(path: str, *, verify: bool = True, allow_pickle: bool = False) -> tuple[dict, list[Any]]:
    """Every part of the sharded checkpoint ``path`` as it was stored, each loaded on its own.

    For a replicated run's checkpoint (DDP ranks sharing the write, ``index["replicated"]``)
    the parts hold disjoint whole tensors, so the union of their state trees is the state;
    a sharded run's parts hold local shards (use :func:`load_full` to assemble them).

    Returns:
        The index (``sharded.json``: ``world_size``, ``replicated``, ``captured_step``,
        ``parts``) and one :class:`gockpt.restore.LoadedState` per part, in rank order.

    Raises:
        FileNotFoundError, ValueError, CheckpointCorruptError: as :class:`GoCkptStorageReader`
            (a part's manifest that does not match the index's checksum, or a part file that
            does not match its manifest).
    """
    from .restore import load_checkpoint

    index = _index(path)
    out = []
    for r, part in enumerate(index["parts"]):
        if part["name"] != part_name(r):  # also keeps every read inside the checkpoint
            raise CheckpointCorruptError(f"{path}/{INDEX_FILE}: part {r} is {part['name']!r}", path=path)
        root = os.path.join(path, part["name"])
        if verify:
            raw = open(os.path.join(root, storage.MANIFEST_NAME), "rb").read()
            if xxhash.xxh3_64(raw).hexdigest() != part["manifest_xxh3_64"]:
                raise CheckpointCorruptError(f"{root}/manifest.json: checksum mismatch", path=path)
        out.append(load_checkpoint(root, verify=verify, allow_pickle=allow_pickle))
    return index, out


def load_full(path: str, *, verify: bool = True, allow_pickle: bool = False) -> FullState:
    """Assemble the sharded checkpoint ``path`` into whole CPU tensors, in this process only.

    ``dcp.load`` runs without a process group (``no_dist``): it reads every stored chunk of
    every tensor into its place.

    Raises:
        FileNotFoundError, ValueError, CheckpointCorruptError: as :class:`GoCkptStorageReader`.
    """
    import torch.distributed.checkpoint as dcp

    reader = GoCkptStorageReader(path, verify=verify)
    md = reader.read_metadata()
    flat = {k: torch.empty(m.size, dtype=m.properties.dtype)
            for k, m in md.state_dict_metadata.items() if isinstance(m, TensorStorageMetadata)}
    with warnings.catch_warnings():  # DCP's note that it loads in one process: asked for here
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.load(flat, storage_reader=reader, no_dist=True)
    model = {k[len("model."):]: v for k, v in flat.items() if k.startswith("model.")}
    optim: dict[str, dict[str, torch.Tensor]] = {}
    for k, v in flat.items():
        if k.startswith("optim.state."):
            fqn, _, name = k[len("optim.state."):].rpartition(".")
            optim.setdefault(fqn, {})[name] = v
    part = _part_state(path, 0, allow_pickle)
    return FullState(model, optim, [sd["param_groups"] for sd in part.optimizer_state_dicts],
                     part.extra, part.captured_step)


def load_sharded(path: str, model: torch.nn.Module,
                 optimizers: torch.optim.Optimizer | Sequence[torch.optim.Optimizer], *,
                 process_group: Any = None, verify: bool = True, allow_pickle: bool = False) -> Any:
    """Load the sharded checkpoint ``path`` into a live model and its optimizers; collective.

    Works with any world size and any placements: the model's and optimizers' state dicts from
    ``torch.distributed.checkpoint.state_dict`` say what each rank holds, ``dcp.load`` reads it
    through :class:`GoCkptStorageReader`, ``set_model_state_dict`` / ``set_optimizer_state_dict``
    put it in place. The parameter groups' hyperparameters are those at the captured step.

    Returns:
        What ``state_fn`` returned at the captured step on this rank (same world size), else
        on rank 0.

    Raises:
        As :class:`GoCkptStorageReader`; ValueError: optimizer groups that do not match.
    """
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = [optimizers] if isinstance(optimizers, torch.optim.Optimizer) else list(optimizers)
    msd = get_model_state_dict(model)
    osd: Any = get_optimizer_state_dict(model, opts)
    dcp.load({"model": msd, "optim": {"state": osd["state"]}},
             storage_reader=GoCkptStorageReader(path, verify=verify), process_group=process_group)
    set_model_state_dict(model, msd)
    saved_world = _index(path)["world_size"]
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    part = _part_state(path, rank if world == saved_world else 0, allow_pickle)
    saved = [g for sd in part.optimizer_state_dicts for g in sd["param_groups"]]
    if len(saved) != len(osd["param_groups"]):
        raise ValueError(f"{path}: {len(saved)} parameter groups stored, the optimizers have "
                         f"{len(osd['param_groups'])}")
    for live, stored in zip(osd["param_groups"], saved, strict=True):
        live.update({k: v for k, v in stored.items() if k != "params"})
    set_optimizer_state_dict(model, opts, osd)
    return part.extra
