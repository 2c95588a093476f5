"""Host snapshot layout and state trees.

A checkpoint stores two kinds of tensors:

- *tracked* tensors (parameters, optimizer state, buffers) that the engine copies into a host
  slot, possibly across several steps, and writes as safetensors shards;
- the caller's *state tree* (e.g. Lightning's checkpoint dict), serialized whole at the captured
  step. Inside it, a tensor that **is** a tracked tensor (same storage, offset, shape, stride and
  dtype) is replaced by a reference to its shard entry; any other tensor (an averaged copy of
  the weights that a hook put there, optimizer state created after the request, ...) is copied
  to the CPU at that moment. The tree is therefore the source of truth: what the caller's hooks
  wrote is what loads, and only tensors that are the live state take the overlapped path.

:func:`save_tree` writes a tree with no live model at all (every tensor stored in shards); it is
the blocking path for saves outside training and for converters.
"""

from __future__ import annotations

import copy
import functools
import io
import math
import pickle
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ._direct import ALIGN as PAGE
from ._direct import aligned_empty
from .format import CheckpointCorruptError, ShardLayout, TensorSpec, plan_shards
from .layout import _dense, storable

REF = "__gockpt_tensor__"
"""Key of a reference marker in a serialized state tree: ``{REF: key, "stride": [...] | None}``,
plus ``"param": requires_grad`` where the tensor was an ``nn.Parameter`` of a user's tree, or
``"requires_grad": True`` where it was another tensor requiring gradients."""

_ALIGN = 64

StorageKey = tuple


def storage_key(t: torch.Tensor) -> StorageKey:
    """Identity of a tensor's memory as a view: device, address of its first element, shape, stride, dtype.

    Two tensors with the same key read the same elements in the same order (``param`` and the
    ``param.detach()`` that ``state_dict()`` returns have equal keys).
    """
    # data_ptr() is the storage's address plus the offset: one call instead of two (it runs
    # for every tensor of every save, on the training thread).
    return (t.device, t.data_ptr(), t.shape, t.stride(), t.dtype)



def _deep_copy(x: Any) -> Any:
    """``copy.deepcopy(x)``, through a pickle round trip where ``x`` pickles: a state_dict's
    ``_metadata`` holds an entry per module and is copied at every capture, on the training
    thread, where ``copy.deepcopy``'s Python recursion cost about 3 us per entry."""
    try:
        return pickle.loads(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL))
    except Exception:  # noqa: BLE001 - not picklable (a local class, a lock): the generic copy
        return copy.deepcopy(x)


#: Leaf types that are immutable and never containers.
_ATOMIC = frozenset({int, float, bool, str, bytes, complex, type(None)})


def map_tree(tree: Any, fn: Callable[[Any], Any], is_leaf: Callable[[Any], bool] = lambda x: False) -> Any:
    """A copy of ``tree`` with ``fn`` applied to every leaf, containers rebuilt with their types.

    Containers: ``dict`` and subclasses (copied with ``copy.copy``, instance attributes such as a
    state_dict's ``_metadata`` deep-copied), plain lists, tuples and named tuples. Anything
    else, or a value for which ``is_leaf`` is true, is a leaf. A container met twice maps to
    one copy, as pickle keeps it (a loaded tree of shared lists is not expanded into an
    exponential one), and a dict or list that holds itself keeps its cycle.

    Raises:
        ValueError: a cycle through a tuple (no copy can hold it before its items exist).
        RecursionError: containers nested deeper than the interpreter's recursion limit.
    """
    # id -> (the container, its copy): the container is kept alive with its id, so a mapping
    # that builds a new container per access cannot reuse the id of one already copied.
    memo: dict[int, tuple[Any, Any]] = {}
    building: set[int] = set()

    def conv(x: Any) -> Any:
        # Tensors and scalars are leaves whatever ``is_leaf`` says: checked first, since a
        # capture maps every tensor and step count of the state, on the training thread.
        if type(x) in _ATOMIC or isinstance(x, torch.Tensor) or is_leaf(x):
            return fn(x)
        if not isinstance(x, (dict, list, tuple)) or (type(x) is not list and isinstance(x, list)):
            return fn(x)
        done = memo.get(id(x))
        if done is not None:
            return done[1]
        if isinstance(x, dict):
            d = copy.copy(x)
            memo[id(x)] = (x, d)
            if vars(x) if hasattr(x, "__dict__") else False:
                d.__dict__.update(_deep_copy(vars(x)))  # e.g. a state_dict's ``_metadata``
            for k in list(d):
                d[k] = conv(x[k])
            return d
        if type(x) is list:
            out: list = []
            memo[id(x)] = (x, out)
            out.extend(conv(v) for v in x)
            return out
        if id(x) in building:
            raise ValueError("the state tree holds a tuple that contains itself")
        building.add(id(x))
        items = [conv(v) for v in x]
        building.discard(id(x))
        t = type(x)(*items) if hasattr(x, "_fields") else type(x)(items)
        memo[id(x)] = (x, t)
        return t

    return conv(tree)



def host_copy(tree: Any) -> tuple[Any, int]:
    """A copy of ``tree`` (nested dicts, lists, tuples) whose tensors are host tensors with
    storages of their own; what an adapter takes at a request, on the training thread.

    Tensors are copied (device-to-host for GPU tensors: this is a stall); other leaves are
    deep-copied, since frameworks pass live objects (a loss scaler) that change after the call.

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


def to_skeleton(tree: Any, live: Mapping[StorageKey, str], *, keep_params: bool = False) -> Any:
    """A copy of ``tree`` safe to serialize later: live tensors become references, others CPU copies.

    Args:
        tree: nested dicts (any ``dict`` subclass, instance attributes such as a state_dict's
            ``_metadata`` kept), lists and tuples (named tuples kept) with tensors and other
            leaves.
        live: :func:`storage_key` of each tracked tensor -> its shard key.
        keep_params: an ``nn.Parameter`` stays one, with its ``requires_grad`` (a user's tree,
            which ``torch.save`` would store so): an untracked one is copied as one, a tracked
            one's reference records it; off for the model's ``state_dict(keep_vars=True)``,
            whose stock form holds plain tensors.

    Returns:
        The same structure; a tensor whose key is in ``live`` is ``{REF: key, "stride": s}``
        (``s`` the strides when the tensor is not contiguous, else None); any other tensor is
        detached and copied to the CPU as ``torch.save`` stores it (views of one storage share
        one copy, a ``Parameter`` stays one); other leaves are deep-copied.
    """
    memo: dict[int, Any] = {}
    storages: dict[tuple, torch.UntypedStorage] = {}

    def leaf(x: Any) -> Any:
        if type(x) in _ATOMIC:  # immutable: deepcopy would return it as is
            return x
        if not isinstance(x, torch.Tensor):
            return copy.deepcopy(x)
        if id(x) not in memo:
            key = live.get(storage_key(x)) if x.layout == torch.strided else None
            if key is None:
                memo[id(x)] = _copy_as_saved(x, storages, keep_params)
            else:
                ref = memo[id(x)] = {REF: key, "stride": None if x.is_contiguous() else list(x.stride())}
                if keep_params and isinstance(x, torch.nn.Parameter):
                    ref["param"] = bool(x.requires_grad)
                elif keep_params and x.requires_grad:
                    ref["requires_grad"] = True
        return memo[id(x)]

    return map_tree(tree, leaf)


#: Bytes up to which an untracked tensor's whole storage is copied, so that its views keep
#: sharing it (beyond, only when the tensor spans at least half of it).
SHARED_STORAGE_COPY_BYTES = 1 << 20


def _copy_as_saved(x: torch.Tensor, storages: dict[tuple, torch.UntypedStorage],
                   keep_params: bool) -> torch.Tensor:
    """A CPU copy of an untracked tensor that ``torch.save`` then stores as it stores ``x``:
    views of one storage stay views of one copied storage (offsets and strides kept), and
    (``keep_params``) a ``Parameter`` stays one, and ``requires_grad`` is kept. Other kinds
    (sparse, subclasses, quantized) are copied on their own."""
    plain = type(x) in (torch.Tensor, torch.nn.Parameter)
    st = x.untyped_storage() if plain and x.layout == torch.strided else None
    if st is None or x.is_quantized or x.device.type == "meta" or x.is_conj() or x.is_neg() or (
            st.nbytes() > max(SHARED_STORAGE_COPY_BYTES, 2 * x.numel() * x.element_size())):
        # (A conjugate or negative view's flag lives on the view, not the storage: copied alone.)
        # A small view of a large storage (a row of a weight, a parameter of a flat buffer)
        # is copied alone: the whole storage would cost host memory torch.save streams.
        y = x.detach().to("cpu", copy=True)
    else:
        k = (x.device, st.data_ptr(), st.nbytes())
        if k not in storages:
            whole = torch.empty(0, dtype=torch.uint8, device=x.device).set_(st)
            storages[k] = whole.to("cpu", copy=True).untyped_storage()
        y = torch.empty(0, dtype=x.dtype).set_(storages[k], x.storage_offset(), x.shape, x.stride())
    if keep_params and isinstance(x, torch.nn.Parameter):
        return torch.nn.Parameter(y, requires_grad=x.requires_grad)
    if keep_params and x.requires_grad:  # torch.save keeps the flag (loaded as a leaf)
        y.requires_grad_(True)
    return y


def _is_ref(x: Any) -> bool:
    return (isinstance(x, dict) and REF in x and "stride" in x
            and (len(x) == 2 or len(x) == 3 and ("param" in x or "requires_grad" in x)))


def references(tree: Any) -> set[str]:
    """The shard keys the reference markers of a :func:`to_skeleton` tree name."""
    found: set[str] = set()

    def leaf(x: Any) -> Any:
        if _is_ref(x):
            found.add(x[REF])
        return x

    map_tree(tree, leaf, is_leaf=_is_ref)
    return found


def resolve(tree: Any, tensors: Mapping[str, torch.Tensor], where: str = "") -> Any:
    """Replace the reference markers of a loaded state tree by the stored tensors.

    Args:
        tree: what :func:`to_skeleton` produced, after a round trip through ``torch.save``.
        tensors: shard key -> tensor as loaded (contiguous).
        where: the checkpoint's path, for error messages.

    Returns:
        The tree with tensors; a tensor saved non-contiguous gets its strides back.

    Raises:
        CheckpointCorruptError: a reference names a key that is not stored, or is malformed; the
            tree is nested too deeply to walk, or holds a tuple that contains itself.
    """
    cache: dict[tuple, torch.Tensor] = {}

    def leaf(x: Any) -> Any:
        if not _is_ref(x):
            return x
        key, stride = x[REF], x["stride"]
        if not isinstance(key, str) or key not in tensors:
            raise CheckpointCorruptError(f"{where}: state refers to tensor {key!r}, which is not stored")
        param, grad = x.get("param"), x.get("requires_grad", False)
        if not (param is None or isinstance(param, bool)) or not isinstance(grad, bool):
            raise CheckpointCorruptError(f"{where}: malformed reference to tensor {key!r}")
        ck = (key, tuple(stride) if isinstance(stride, list) else None, param, grad)
        if ck not in cache:
            t = tensors[key]
            if stride is not None:
                if not (isinstance(stride, list) and len(stride) == t.dim()
                        and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0
                                for s in stride)):
                    raise CheckpointCorruptError(f"{where}: malformed strides for tensor {key!r}")
                _check_strides(t, stride, key, where)
                t = torch.empty_strided(t.shape, stride, dtype=t.dtype).copy_(t)
            # As torch.save keeps them: an nn.Parameter, a tensor's requires_grad (a new tensor
            # object over the same memory, so other references to the key are left as they are).
            differentiable = t.is_floating_point() or t.is_complex()
            if param is not None:
                t = torch.nn.Parameter(t, requires_grad=param and differentiable)
            elif grad and differentiable:
                t = t.detach().requires_grad_(True)
            cache[ck] = t
        return cache[ck]

    try:
        return map_tree(tree, leaf, _is_ref)
    except CheckpointCorruptError:
        raise
    except (RecursionError, ValueError) as e:
        raise CheckpointCorruptError(f"{where}: malformed state tree ({e})") from None


#: How many elements a restored view may span per element it holds: a saved view with gaps
#: (a column slice) spans more than it holds; a hostile stride would span terabytes.
MAX_STRIDED_SPAN = 64


def _check_strides(t: torch.Tensor, stride: list[int], key: str, where: str) -> None:
    """Refuse strides under which elements overlap (a live tensor's own strides never do) or
    that span more than :data:`MAX_STRIDED_SPAN` times the elements held.

    Raises:
        CheckpointCorruptError: naming the tensor.
    """
    dims = sorted((s, n) for s, n in zip(stride, t.shape) if n > 1)
    reach = 1  # elements spanned by the dimensions of smaller stride
    for s, n in dims:
        if s < reach:
            raise CheckpointCorruptError(
                f"{where}: strides {stride} of tensor {key!r} (shape {list(t.shape)}) overlap")
        reach = s * (n - 1) + reach
    if t.numel() and reach > MAX_STRIDED_SPAN * t.numel():
        raise CheckpointCorruptError(
            f"{where}: strides {stride} of tensor {key!r} span {reach} elements for "
            f"{t.numel()} held")


@dataclass(frozen=True)
class SlotLayout:
    """Where each stored tensor lives in a host slot and in the shard files.

    Attributes:
        shards: shard layouts (file names with the prefix ``"shard"``).
        bases: byte offset in the slot of each shard's data section: its header's length
            past a page boundary, so the data lies on pages where its file offset does (the
            persist writes it with ``O_DIRECT`` straight from the slot, :mod:`gockpt._direct`);
            a multiple of 8 (headers are padded to 8 bytes).
        offsets: tensor key -> byte offset in the slot.
        nbytes: slot size in bytes (>= 64).
    """

    shards: list[ShardLayout]
    bases: list[int]
    offsets: dict[str, int]
    nbytes: int

    def with_prefix(self, prefix: str) -> list[ShardLayout]:
        """The shard layouts with file names unique to one save (``shard`` -> ``prefix``)."""
        return [ShardLayout(s.file.replace("shard", prefix, 1), s.header, s.offsets, s.data_bytes)
                for s in self.shards]


def plan_slot(specs: list[TensorSpec], max_shard_bytes: int,
              apart: frozenset[str] | set[str] = frozenset()) -> SlotLayout:
    """Lay out tensors in shards of at most ``max_shard_bytes`` and the shards in one host slot.

    ``apart``: keys laid out in shards of their own (``shard-frozen-*``, after the others):
    frozen tensors, so that a shard holding only tensors that did not change since the last
    checkpoint can be linked rather than written again (``frozen_copy="when_changed"``).

    Raises:
        ValueError, TypeError: from :func:`gockpt.format.plan_shards`.
    """
    rest = [sp for sp in specs if sp.key not in apart]
    kept = [sp for sp in specs if sp.key in apart]
    shards = plan_shards(rest, max_shard_bytes, "shard") if rest or not kept else []
    if kept:
        shards += plan_shards(kept, max_shard_bytes, "shard-frozen")
    bases, off = [], 0
    offsets: dict[str, int] = {}
    for sh in shards:
        off = -(-off // PAGE) * PAGE + len(sh.header) % PAGE
        bases.append(off)
        for k, (b, _) in sh.offsets.items():
            offsets[k] = off + b
        off += sh.data_bytes
    return SlotLayout(shards, bases, offsets, max(-(-off // _ALIGN) * _ALIGN, _ALIGN))


def host_view(buf: torch.Tensor, offset: int, like: torch.Tensor | TensorSpec) -> torch.Tensor:
    """A contiguous view of ``like``'s dtype and shape into the uint8 buffer ``buf`` at ``offset`` bytes."""
    dtype, shape = (like.dtype, like.shape)
    n = math.prod(shape) * dtype.itemsize
    return buf[offset: offset + n].view(dtype).view(shape)


def collect_tensors(tree: Any) -> dict[str, torch.Tensor]:
    """Every distinct tensor of ``tree`` (by :func:`storage_key`) that a shard can hold
    (:func:`gockpt.layout.storable`), keyed by its dotted path; the others stay in the tree."""
    found: dict[StorageKey, str] = {}
    out: dict[str, torch.Tensor] = {}
    seen: dict[int, Any] = {}  # containers walked (kept alive): a shared one once, a cycle ends

    def walk(x: Any, path: str) -> None:
        if isinstance(x, (dict, list, tuple)):
            if id(x) in seen:
                return
            seen[id(x)] = x
        if isinstance(x, torch.Tensor):
            if not storable(x):
                return
            sk = storage_key(x)
            if sk not in found:
                key = path or "tensor"
                while key in out:
                    key += "_"
                found[sk] = key
                out[key] = x
        elif isinstance(x, dict):
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                walk(v, f"{path}.{i}" if path else str(i))

    walk(tree, "")
    return out


def save_tree(
    path: str,
    tree: Any,
    *,
    model: Mapping[str, Any] | None = None,
    optimizers: Sequence[Mapping[str, Any]] = (),
    step: int = 0,
    storage_options: Mapping[str, Any] | None = None,
    max_shard_bytes: int = 1 << 30,
    num_io_threads: int = 4,
    update_latest: bool = True,
    meta: Mapping[str, Any] | None = None,
    on_published: Callable[[], None] | None = None,
) -> int:
    """Write ``tree`` as a complete GoCkpt checkpoint, blocking (no live model needed).

    Every tensor of the tree (any device) is copied to a host slot and stored in safetensors
    shards, but for those a shard cannot hold (sparse, complex: :func:`gockpt.layout.storable`),
    which stay in the tree; the tree itself is stored with references to them, so
    :func:`gockpt.load_checkpoint` returns it as ``extra``. With ``model`` and ``optimizers``
    the checkpoint is the one a :class:`gockpt.Engine` writes: ``load_checkpoint`` returns
    them as ``model_state_dict`` and ``optimizer_state_dicts``, and ``Engine.restore`` loads
    it. A tensor met twice (tied weights, or the same tensor in two of the trees) is stored
    once and loads as one tensor object. Used for saves outside training and by converters.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        tree: nested containers with tensors (e.g. Lightning's checkpoint dict).
        model: a ``model.state_dict()``-shaped dict (tensors and extra state), or None.
        optimizers: ``optimizer.state_dict()``-shaped dicts, one per optimizer.
        step: recorded as requested and captured step (orders the ``latest`` pointer, after the
            run: each call is a run of its own, started at the call, unless ``meta`` gives
            ``run``; see :func:`gockpt.storage.advance_latest`).
        storage_options: fsspec options.
        max_shard_bytes: upper bound on tensor bytes per shard file.
        num_io_threads: threads writing files.
        update_latest: move the ``latest`` pointer in the parent directory.
        meta: extra JSON-able metadata for the manifest.
        on_published: called right after the publish.

    Returns:
        Bytes written.

    Raises:
        ValueError: an optimizer state dict that is not a dict with a ``state`` dict and
            ``param_groups`` (the loader would refuse it); a name GoCkpt keeps
            (:func:`gockpt.storage.check_save_path`).
        FileExistsError: ``path`` is a local directory that is not empty and holds no
            checkpoint.
        OSError, CheckpointError: from the storage (the previous checkpoint at ``path`` is intact).
    """
    from .fsutil import path_key
    from .persist import PersistRequest, persist
    from .storage import check_save_path

    check_save_path(path_key(path), update_latest=update_latest)  # before any tensor is copied
    model_sd = dict(model) if model is not None and not isinstance(model, dict) else (model or {})
    opt_sds = list(optimizers)
    for i, sd in enumerate(opt_sds):
        if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and "param_groups" in sd):
            raise ValueError(f"optimizers[{i}] is not an optimizer state_dict (a dict with a "
                             "'state' dict and 'param_groups')")
    tensors: dict[str, torch.Tensor] = {}
    live: dict[StorageKey, str] = {}
    # The tree's tensors keep the names a tree-only save gives them; the model's and the
    # optimizers' are named as in the engine ("model.<key>", "optim.<i>....").
    for part in (tree, {"model": model_sd, "optim": opt_sds}):
        for k, t in collect_tensors(part).items():
            sk = storage_key(t)
            if sk in live:
                continue
            while k in tensors:
                k += "_"
            live[sk] = k
            tensors[k] = t.detach()
    specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
    slot_layout = plan_slot(specs, max_shard_bytes)
    slot = aligned_empty(slot_layout.nbytes)
    for k, t in tensors.items():
        host_view(slot, slot_layout.offsets[k], t).copy_(t)
    buf = io.BytesIO()
    # The engine's state-tree blob (gockpt.restore._from_trees reads it).
    torch.save({"user": to_skeleton(tree, live, keep_params=True),
                "optimizers": [to_skeleton(sd, live) for sd in opt_sds],
                "model": to_skeleton(model_sd, live), "model_extra": {}}, buf)
    model_keys = [k for k, v in model_sd.items() if isinstance(v, torch.Tensor)]
    m = {"requested_step": int(step), "captured_step": int(step), "mode": "sync",
         "num_overlap_steps": 1, "model_keys": model_keys, "num_optimizers": len(opt_sds),
         "tree": True, "created_unix_s": time.time(),
         "run": time.time_ns(),  # a save of its own: a run of one checkpoint
         **dict(meta or {})}
    req = PersistRequest(
        path=path.rstrip("/") or path, shards=slot_layout.with_prefix(f"shard-{uuid.uuid4().hex[:8]}"),
        slot=slot, shard_bases=slot_layout.bases, extra=buf.getvalue(), aliases={}, meta=m,
        storage_options=dict(storage_options or {}), num_io_threads=num_io_threads,
        update_latest=update_latest, on_published=on_published or (lambda: None))
    return persist(req).bytes_written


def map_views_once(tree: Any, fn: Any) -> Any:
    """``tree`` with ``fn(tensor)`` in place of every tensor, called once per place in memory:
    views of one place (tied weights, the same tensor met twice) map to one result object."""
    memo: dict[tuple, Any] = {}

    def leaf(x: Any) -> Any:
        if not isinstance(x, torch.Tensor):
            return x
        if x.layout != torch.strided:  # sparse: no storage of its own; one object, one place
            where: tuple = ("object", id(x))
        else:
            where = (x.untyped_storage().data_ptr(), int(x.storage_offset()), tuple(x.shape),
                     tuple(x.stride()), x.dtype)
        if where not in memo:
            memo[where] = fn(x)
        return memo[where]

    return map_tree(tree, leaf)


def own_storage(tree: Any, *, keep_strides: bool = False) -> Any:
    """``tree`` with every tensor copied into a storage of its own (detached; contiguous unless
    ``keep_strides``, see :func:`own_copy`).

    Tensors of a snapshot or of a loaded GoCkpt shard are views of one buffer: ``torch.save``
    would write the whole buffer for each, and safetensors refuses them. Views of one place
    (tied weights, the same tensor met twice) stay one tensor object.
    """
    return map_views_once(tree, functools.partial(own_copy, keep_strides=keep_strides))


def own_copy(x: torch.Tensor, *, keep_strides: bool = False) -> torch.Tensor:
    """A detached copy of ``x`` in memory of its own: contiguous where strided (a sparse
    tensor has no memory format to ask for). ``keep_strides``: a tensor covering one dense
    range of its storage in another order (a transpose, channels_last) keeps its strides, as
    ``torch.save`` of the original would; safetensors needs contiguous tensors, so not there."""
    x = x.detach()
    if x.layout != torch.strided:
        return x.clone()
    if keep_strides and not x.is_contiguous() and _dense(x):
        return torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, device=x.device).copy_(x)
    return x.contiguous().clone()


def untie(state_dict: Mapping[str, Any]) -> dict[str, Any]:
    """``state_dict`` with each tensor kept once, under the first name that holds it.

    Tied weights are one tensor under several names; safetensors refuses shared memory, and
    its loaders (``load_model``) tie them again. Non-tensor values are kept as they are.
    """
    seen: set[StorageKey] = set()
    out: dict[str, Any] = {}
    for k, v in state_dict.items():
        if isinstance(v, torch.Tensor):
            key = storage_key(v)
            if key in seen:
                continue
            seen.add(key)
        out[k] = v
    return out


def to_bytes(obj: Any) -> bytes:
    """``torch.save`` of ``obj`` into memory, each tensor with a storage of its own (:func:`own_storage`)."""
    buf = io.BytesIO()
    torch.save(own_storage(obj), buf)
    return buf.getvalue()
