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

import math
import os
import warnings
from collections.abc import Mapping, Sequence
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
from ._safe_read import open_local_regular, require_directory
from .errors import CheckpointCorruptError
from .format import CODE_TO_DTYPE, decode_json, is_int, is_shape
from .load import check_shard_header, read_listed, read_shard_header
from .manifest import by_file as manifest_by_file
from .manifest import validate_manifest
from .sharded import INDEX_FILE, part_name, sharding_name

__all__ = ["GoCkptStorageReader", "FullState", "load_full", "load_parts", "load_sharded"]


@dataclass(frozen=True)
class _Stored:
    file: str  # absolute path of the safetensors shard
    key: str  # the tensor's name in it (a GoCkpt layout key)


def _index(path: str) -> tuple[dict, dict]:
    """The index (``sharded.json``) and the global manifest of the sharded checkpoint ``path``.

    Read like every file of an untrusted checkpoint: a regular file only (no symlink, FIFO or
    device), its size the one the global manifest records, its checksum checked, its JSON
    strict; every part is named ``rank-<r>`` (so reads stay inside the checkpoint).

    Raises:
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: ``path`` is not a sharded checkpoint.
        CheckpointCorruptError: the index is missing, not a regular file, malformed, or does not
            match the global manifest (names the file).
    """
    fs, root = fsutil.url_to_fs(path, None)
    try:
        manifest = storage.read_manifest(fs, root)
    except (FileNotFoundError, NotADirectoryError):
        raise FileNotFoundError(f"{path} is not a complete GoCkpt checkpoint (no manifest.json)") from None
    if "sharded" not in manifest["meta"]:
        raise ValueError(f"{path} is not a sharded GoCkpt checkpoint; use gockpt.load_checkpoint")
    index_path = fsutil.join(root, INDEX_FILE)
    raw = _read_listed(fs, index_path, manifest["files"].get(INDEX_FILE), True)
    index = decode_json(raw, index_path)

    def bad(msg: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{index_path}: {msg}", path=index_path)

    if not isinstance(index, dict) or not isinstance(index.get("parts"), list):
        raise bad("not a JSON object with a 'parts' list")
    world = index.get("world_size")
    if not is_int(world) or world < 1:
        raise bad(f"world_size {world!r} is not a positive integer")
    for r, part in enumerate(index["parts"]):
        if not isinstance(part, dict):
            raise bad(f"part {r} is not an object: {part!r}")
        if part.get("name") != part_name(r):  # also keeps every read inside the checkpoint
            raise bad(f"part {r} is {part.get('name')!r}")
        if not (is_int(part.get("manifest_bytes"))
                and isinstance(part.get("manifest_xxh3_64"), str)):
            raise bad(f"part {r}: malformed 'manifest_bytes' / 'manifest_xxh3_64'")
    return index, manifest


#: torch dtype name (``float32``, as ``rank-<r>.sharding.json`` records it) -> dtype.
_DTYPES: dict[Any, torch.dtype] = {str(d).removeprefix("torch."): d for d in CODE_TO_DTYPE.values()}


def _read_listed(fs: Any, file_path: str, entry: Any, verify: bool) -> bytes:
    """The bytes of a metadata file whose size and checksum a manifest or index records: at
    most ``storage.MAX_METADATA_BYTES`` (:func:`gockpt.load.read_listed`).

    Raises:
        CheckpointCorruptError: no record, the file missing, not a regular file, over the
            bound, or not the recorded size or checksum (names the file).
    """
    if not (isinstance(entry, dict) and is_int(entry.get("bytes"))):
        raise CheckpointCorruptError(f"{file_path}: not listed in the checkpoint's manifest",
                                     path=file_path)
    return read_listed(fs, file_path, entry, verify, max_bytes=storage.MAX_METADATA_BYTES)


def _part_manifest(fs: Any, path: str, index: dict, r: int, verify: bool) -> tuple[str, dict]:
    """(directory, validated manifest) of part ``r``, its manifest read once, bounded, and
    (with ``verify``) checked against the index's checksum."""
    part = index["parts"][r]
    root = os.path.join(path, part["name"])
    require_directory(root)  # never a link to a directory outside the checkpoint
    manifest_path = os.path.join(root, storage.MANIFEST_NAME)
    entry = {"bytes": part["manifest_bytes"], "xxh3_64": part["manifest_xxh3_64"]}
    raw = _read_listed(fs, manifest_path, entry, verify)
    return root, validate_manifest(decode_json(raw, manifest_path), manifest_path)


def _sharding(fs: Any, path: str, r: int, top: dict, manifest: dict) -> dict:
    """Part ``r``'s ``rank-<r>.sharding.json``, read bounded and checked against the global
    manifest ``top``, every entry checked against the part's ``manifest``.

    Raises:
        CheckpointCorruptError: a malformed file or entry (names the file and the key).
    """
    file_path = os.path.join(path, sharding_name(r))
    raw = _read_listed(fs, file_path, top["files"].get(sharding_name(r)), True)
    sharding = decode_json(raw, file_path)

    def bad(msg: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{file_path}: {msg}", path=file_path)

    if not (isinstance(sharding, dict) and isinstance(sharding.get("tensors"), dict)
            and isinstance(sharding.get("aliases"), dict)):
        raise bad("not a JSON object with 'tensors' and 'aliases' objects")
    if not all(isinstance(a, str) and isinstance(t, str) for a, t in sharding["aliases"].items()):
        raise bad("an alias that is not a string")
    for key, info in sharding["tensors"].items():
        entry = manifest["tensors"].get(key)
        if entry is None:
            raise bad(f"tensor {key!r} is not in the part's manifest")
        if not isinstance(info, dict):
            raise bad(f"tensor {key!r}: malformed entry")
        dtype = info.get("dtype")
        if not isinstance(dtype, str) or _DTYPES.get(dtype) != CODE_TO_DTYPE[entry["dtype"]]:
            raise bad(f"tensor {key!r}: dtype {info.get('dtype')!r} is not the stored "
                      f"{entry['dtype']}")
        glob, offsets, shape = info.get("global_shape"), info.get("offsets"), entry["shape"]
        if not (
            isinstance(info.get("fqn"), str)
            and is_int(info.get("replica"))
            and is_shape(glob)
            and is_shape(offsets)
            and len(glob) == len(offsets) == len(shape)
            and all(o + n <= g for o, n, g in zip(offsets, shape, glob, strict=True))
        ):
            raise bad(f"tensor {key!r}: malformed fqn, replica, global_shape or offsets (the "
                      f"stored {shape} at the offsets must lie inside the global shape)")
    return sharding


class GoCkptStorageReader(StorageReader):
    """A DCP ``StorageReader`` over a sharded GoCkpt checkpoint directory.

    Args:
        path: the checkpoint directory (local path).
        verify: check each part's manifest against the index and every file's size and
            xxh3-64 checksum against its part's manifest before reading.

    Raises (from :meth:`read_metadata`):
        FileNotFoundError: no complete checkpoint at ``path``.
        ValueError: ``path`` is not a sharded checkpoint.
        CheckpointCorruptError: a part or file that does not match its checksum, a file that is
            not a regular file (a symlink, FIFO or device: refused, never read), a metadata file
            over its size bound, malformed JSON or entries, a part not named ``rank-<r>``; the
            message names the file.
    """

    def __init__(self, path: str, *, verify: bool = True) -> None:
        super().__init__()
        self.path = str(path)
        self.verify = verify
        self.storage_data: dict[MetadataIndex, _Stored] = {}
        self._metadata: Metadata | None = None  # read (and verified) once per path

    def reset(self, checkpoint_id: str | os.PathLike | None = None) -> None:
        if checkpoint_id is not None:
            self.path = str(checkpoint_id)
        self.storage_data = {}
        self._metadata = None

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return os.path.isfile(os.path.join(checkpoint_id, INDEX_FILE))

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if self._metadata is not None:
            return self._metadata
        index, top = _index(self.path)
        fs = fsutil.url_to_fs(self.path, None)[0]
        md: dict[str, TensorStorageMetadata] = {}
        data: dict[MetadataIndex, _Stored] = {}
        where: dict[str, str] = {}  # fqn -> the sharding file that declared it first
        for r in range(len(index["parts"])):
            root, manifest = _part_manifest(fs, self.path, index, r, self.verify)
            _check_files(root, manifest, self.verify)
            sharding = _sharding(fs, self.path, r, top, manifest)
            file_path = os.path.join(self.path, sharding_name(r))
            for key, info in sharding["tensors"].items():
                where.setdefault(info["fqn"], file_path)
                if info["replica"] != 0:
                    continue  # the same chunk is read from the part that holds replica 0
                entry = manifest["tensors"][key]
                stored = _Stored(os.path.join(root, entry["file"]), entry.get("key", key))
                names = [info["fqn"]] + [a for a, t in sharding["aliases"].items() if t == info["fqn"]]
                for fqn in names:
                    tmd = md.get(fqn)
                    if tmd is None:
                        tmd = md[fqn] = TensorStorageMetadata(
                            TensorProperties(dtype=_DTYPES[info["dtype"]]),
                            torch.Size(info["global_shape"]), [])
                    elif (list(tmd.size), tmd.properties.dtype) != (info["global_shape"], _DTYPES[info["dtype"]]):
                        raise CheckpointCorruptError(
                            f"{file_path}: tensor {key!r}: {fqn} is {info['dtype']} "
                            f"{info['global_shape']} here, {tmd.properties.dtype} {list(tmd.size)} "
                            "in another entry", path=file_path)
                    tmd.chunks.append(ChunkStorageMetadata(torch.Size(info["offsets"]),
                                                           torch.Size(entry["shape"])))
                    data[MetadataIndex(fqn, info["offsets"])] = stored
        for fqn in where.keys() | md.keys():  # md: aliases too
            _check_cover(fqn, md.get(fqn), where.get(fqn, self.path))
        self.storage_data = data
        self._metadata = Metadata(state_dict_metadata=md, storage_data=data)  # type: ignore[arg-type]
        return self._metadata

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
            os.close(open_local_regular(file)[0])  # never hand a FIFO or a link to safe_open
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


def _check_cover(fqn: str, tmd: TensorStorageMetadata | None, file_path: str) -> None:
    """The stored chunks of ``fqn`` tile its global shape: none overlaps another, and their
    elements add up to the whole tensor (else a load would leave part of it unread: garbage
    in a new tensor, stale values in a live one).

    Raises:
        CheckpointCorruptError: naming ``file_path``, a sharding file that declares ``fqn``.
    """
    def bad(msg: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{file_path}: {fqn}: {msg}", path=file_path)

    if tmd is None:
        raise bad("no part stores its first replica")
    chunks = sorted(((tuple(c.offsets), tuple(c.sizes)) for c in tmd.chunks))
    total = math.prod(tmd.size)
    if sum(math.prod(n) for _, n in chunks) != total:
        raise bad(f"the stored chunks hold {sum(math.prod(n) for _, n in chunks)} elements of "
                  f"its {total} ({list(tmd.size)})")
    if not tmd.size:
        if len(chunks) != 1:
            raise bad(f"a scalar stored {len(chunks)} times")
        return
    # A sweep along the dimension the chunks split most (the sharded one): only chunks whose
    # ranges there meet can overlap, so the work stays near-linear in the number of chunks.
    d = max(range(len(tmd.size)), key=lambda i: len({off[i] for off, _ in chunks}))
    chunks.sort(key=lambda c: c[0][d])
    open_: list[tuple[tuple[int, ...], tuple[int, ...]]] = []
    for off, n in chunks:
        if not all(n):
            continue  # no elements: overlaps nothing
        open_ = [(o, m) for o, m in open_ if o[d] + m[d] > off[d]]
        for o, m in open_:
            if all(a < b + k and b < a + j for a, j, b, k in zip(off, n, o, m, strict=True)):
                raise bad(f"the chunks at offsets {list(o)} and {list(off)} overlap")
        open_.append((off, n))


def _check_files(root: str, manifest: dict, verify: bool) -> None:
    """Every file of a part's ``manifest``: a regular file (no symlink, FIFO or device) of the
    recorded size, a shard's header equal to the manifest's index of it (so safetensors never
    parses a header the manifest does not describe), and with ``verify`` the recorded xxh3-64
    checksum, read from the descriptor that was checked and never past the recorded size."""
    index = manifest_by_file(manifest)
    for name, entry in manifest["files"].items():
        file_path = os.path.join(root, name)
        try:
            fd, size = open_local_regular(file_path, expected_bytes=entry["bytes"])
        except (FileNotFoundError, NotADirectoryError):
            raise CheckpointCorruptError(f"{file_path}: file listed in the manifest is missing",
                                         path=file_path) from None
        with os.fdopen(fd, "rb") as f:
            if name in index:
                check_shard_header(file_path, read_shard_header(fd, size), size, index[name])
            if not verify:
                continue
            h, left = xxhash.xxh3_64(), size
            while left and (chunk := f.read(min(left, 8 << 20))):
                h.update(chunk)
                left -= len(chunk)
        if left or h.hexdigest() != entry["xxh3_64"]:
            raise CheckpointCorruptError(f"{file_path}: size or checksum mismatch", path=file_path)


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

    index = _index(path)[0]
    fs = fsutil.url_to_fs(path, None)[0]
    out = []
    for r, part in enumerate(index["parts"]):
        root = os.path.join(path, part["name"])  # a checked name: rank-<r>
        require_directory(root)
        if verify:
            _part_manifest(fs, path, index, r, verify)
        out.append(load_checkpoint(root, verify=verify, allow_pickle=allow_pickle))
    return index, out


def _in_state_tree(keys: Mapping[str, Any], stored: Mapping[str, Any], part: Any) -> dict[str, torch.Tensor]:
    """The model tensors of ``keys`` that no shard stores (``stored``: the shards' metadata, by
    ``model.<fqn>``) and ``part``'s state tree holds: plain tensors of a kind the shards cannot
    hold (a complex rotary table: :func:`gockpt.layout.storable`), every rank's whole copy
    kept in its part."""
    tree = part.model_state_dict
    return {k: tree[k] for k in keys
            if f"model.{k}" not in stored and isinstance(tree.get(k), torch.Tensor)}


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
    model.update(_in_state_tree(part.model_state_dict, md.state_dict_metadata, part))
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
    ``optimizers`` may be empty: the model alone (evaluation). Model tensors no shard holds (a
    plain complex buffer) come from the part's state tree: this rank's part at the saved world
    size, rank 0's at another.

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
    reader = GoCkptStorageReader(path, verify=verify)
    stored = reader.read_metadata().state_dict_metadata  # kept for dcp.load's own read
    saved_world = _index(path)[0]["world_size"]
    rank = dist.get_rank(process_group) if dist.is_initialized() else 0
    world = dist.get_world_size(process_group) if dist.is_initialized() else 1
    part = _part_state(path, rank if world == saved_world else 0, allow_pickle)
    kept = _in_state_tree(msd, stored, part)
    state: dict[str, Any] = {"model": {k: v for k, v in msd.items() if k not in kept}}
    osd: Any = get_optimizer_state_dict(model, opts) if opts else None
    if opts:
        state["optim"] = {"state": osd["state"]}
    dcp.load(state, storage_reader=reader, process_group=process_group)
    msd.update(kept)
    set_model_state_dict(model, msd)
    if not opts:  # the model only (evaluation)
        return part.extra
    saved = [g for sd in part.optimizer_state_dicts for g in sd["param_groups"]]
    if len(saved) != len(osd["param_groups"]):
        raise ValueError(f"{path}: {len(saved)} parameter groups stored, the optimizers have "
                         f"{len(osd['param_groups'])}")
    for live, stored in zip(osd["param_groups"], saved, strict=True):
        live.update({k: v for k, v in stored.items() if k != "params"})
    set_optimizer_state_dict(model, opts, osd)
    return part.extra
