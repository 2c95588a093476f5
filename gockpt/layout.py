"""State layout: every tensor of a checkpoint, grouped into units (a parameter and its optimizer state).

Keys in a checkpoint:

- ``model.<state_dict key>`` for parameters and buffers (tied parameters are stored once; the
  other names are aliases);
- ``optim.<i>.<param index>.<state name>`` for per-parameter optimizer state of optimizer ``i``,
  with the parameter index that ``optimizer.state_dict()`` uses.

A *unit* is one optimizer parameter with all of its optimizer state (GoCkpt §4.2.2 keeps them in
one block so a block can be replayed on its own). Buffers and parameters that no optimizer owns
form the *static* part, taken at the captured step.

Sharded tensors (FSDP2's ``DTensor`` parameters and optimizer state) are stored as their local
shard (``DTensor.to_local()``): each rank's engine copies and replays only what it holds. The
entry keeps the ``DTensor`` (:attr:`Entry.owner`: in-place updates bump its version counter, not
the local tensor's) and where the shard lies in the global tensor (:class:`ShardInfo`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.optim import Optimizer

from .format import DTYPE_TO_CODE, TensorSpec, dtype_code

if TYPE_CHECKING:
    from .partition import Partition


_DTENSOR: list[type] = []


def is_dtensor(t: object) -> bool:
    """Whether ``t`` is a ``torch.distributed.tensor.DTensor`` (False where torch lacks it)."""
    if not isinstance(t, torch.Tensor) or type(t) is torch.Tensor or type(t) is nn.Parameter:
        return False
    if not _DTENSOR:
        try:
            from torch.distributed.tensor import DTensor
        except ImportError:  # pragma: no cover - torch built without distributed
            return False
        _DTENSOR.append(DTensor)
    return isinstance(t, _DTENSOR[0])


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a ``DTensor`` (a view of its memory, detached); other tensors as they are."""
    if type(t) is torch.Tensor or type(t) is nn.Parameter:  # the common case, checked per tensor
        return t
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local().detach()  # type: ignore[attr-defined]
    return t


def localize(tree: object) -> object:
    """``tree`` (dicts, lists, tuples) with every ``DTensor`` replaced by :func:`local` of it."""
    if is_dtensor(tree):
        return local(tree)  # type: ignore[arg-type]
    if isinstance(tree, dict):
        out = {k: localize(v) for k, v in tree.items()}
        return out if type(tree) is dict else _same_kind(tree, out)
    if isinstance(tree, list):
        return [localize(v) for v in tree]
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(localize(v) for v in tree)
    return tree


def _same_kind(tree: dict, out: dict) -> dict:
    try:
        copy = tree.copy()  # keeps the mapping's type (OrderedDict)
        copy.update(out)
        if hasattr(tree, "_metadata"):
            copy._metadata = tree._metadata  # type: ignore[attr-defined]  # state_dict versions
        return copy
    except Exception:  # noqa: BLE001 - a mapping that cannot be copied: a plain dict
        return out


@dataclass(frozen=True)
class ShardInfo:
    """Where a stored local shard lies in its global (``DTensor``) tensor.

    Attributes:
        global_shape: shape of the whole tensor (elements per dimension).
        offsets: index of the shard's first element in each dimension.
        placements: ``str()`` of each placement (``"S(0)"``: sharded on dim 0, ``"R"``: replicated).
        mesh_shape: shape of the device mesh.
        replica: 0 for the copy of a shard that a reader should use; > 0 for the same shard
            held again by another rank (a ``Replicate`` mesh dimension).
    """

    global_shape: tuple[int, ...]
    offsets: tuple[int, ...]
    placements: tuple[str, ...]
    mesh_shape: tuple[int, ...]
    replica: int = 0

    @staticmethod
    def of(t: torch.Tensor) -> ShardInfo:
        """The shard of this rank of the ``DTensor`` ``t`` (DCP's ``__create_chunk_list__``)."""
        from torch.distributed.tensor import Replicate

        chunk = t.__create_chunk_list__()[0]  # type: ignore[attr-defined]
        mesh, placements = t.device_mesh, t.placements  # type: ignore[attr-defined]
        coord = mesh.get_coordinate() or [0] * mesh.ndim
        replica = 0
        for dim, pl in enumerate(placements):
            if isinstance(pl, Replicate):
                replica = replica * mesh.size(dim) + coord[dim]
        return ShardInfo(tuple(t.shape), tuple(chunk.offsets), tuple(str(p) for p in placements),
                         tuple(mesh.shape), replica)


@dataclass
class Entry:
    """One stored tensor.

    Attributes:
        key: checkpoint key.
        tensor: the live tensor (any device).
        spec: its stored metadata.
    """

    key: str
    tensor: torch.Tensor
    spec: TensorSpec
    owner: torch.Tensor | None = None
    shard: ShardInfo | None = None

    @property
    def versioned(self) -> torch.Tensor:
        """The tensor whose ``_version`` counts in-place updates: the ``DTensor``, or ``tensor``."""
        return self.tensor if self.owner is None else self.owner


@dataclass
class Unit:
    """A parameter owned by an optimizer, with its optimizer state.

    Attributes:
        optimizer_index: which optimizer owns it.
        group_index: its param group.
        param_index: its index in ``optimizer.state_dict()["state"]``.
        param: the live parameter.
        param_entry: the stored parameter.
        state_entries: state name -> stored optimizer state tensor.
    """

    optimizer_index: int
    group_index: int
    param_index: int
    param: torch.Tensor
    param_entry: Entry
    state_entries: dict[str, Entry]

    # A unit is not changed once built (a new optimizer state or storage makes a new layout),
    # and these are read for every unit at every request: computed once.
    @cached_property
    def entries(self) -> tuple[Entry, ...]:
        """The stored parameter, then its optimizer state tensors."""
        return (self.param_entry, *self.state_entries.values())

    @cached_property
    def state_bytes(self) -> int:
        """Bytes of the parameter plus its optimizer state."""
        return sum(e.spec.nbytes for e in self.entries)

    @property
    def grad_bytes(self) -> int:
        """Bytes of the parameter's gradient (same dtype and shape as the parameter)."""
        return self.param_entry.spec.nbytes


@dataclass
class StateLayout:
    """All tensors of a checkpoint of one model and its optimizers.

    Attributes:
        units: optimizer-owned parameters with their state, in optimizer order.
        static: buffers and parameters without an optimizer.
        aliases: alias key -> canonical key (tied parameters).
        model_keys: ``model.state_dict()`` keys in order (tensor keys only).
        signature: (key, dtype, shape) of every stored tensor, to notice when the layout changes.
        partition: for a rank sharing the write of a replicated state (DDP), which units it
            stores (:mod:`gockpt.partition`); None when the layout is everything this rank holds.
        left_out: keys of the tensors no shard can hold (:func:`storable`): model keys
            (``model.<fqn>``) and the parameters of the units left out; the state tree stores
            them.
    """

    @cached_property
    def sharded(self) -> bool:
        """Whether some entry is the local shard of a ``DTensor`` (a layout is not changed once
        built: computed once, it is read at every request and capture)."""
        return any(e.shard is not None for e in self.entries)

    units: list[Unit]
    static: list[Entry]
    aliases: dict[str, str]
    model_keys: list[str]
    signature: tuple = field(default=())
    partition: Partition | None = None
    left_out: tuple[str, ...] = ()

    @cached_property
    def entries(self) -> tuple[Entry, ...]:
        """Every stored tensor (units first, then static)."""
        out = []
        for u in self.units:
            out.extend(u.entries)
        out.extend(self.static)
        return tuple(out)


def _entry(key: str, t: torch.Tensor) -> Entry:
    if is_dtensor(t):
        e = _entry(key, local(t))
        e.owner, e.shard = t, ShardInfo.of(t)
        return e
    # Stored in logical (contiguous) order; a non-contiguous but dense tensor (channels_last) is
    # copied element-wise and the state tree records its strides, so it loads as it was saved.
    if t.layout != torch.strided or not _dense(t):
        raise ValueError(f"tensor {key!r} overlaps itself or is sparse; GoCkpt stores dense tensors only")
    spec = TensorSpec(key, t.dtype, tuple(t.shape))
    dtype_code(t.dtype, key)  # raises TypeError for dtypes safetensors cannot store
    return Entry(key, t, spec)


def storable(t: torch.Tensor) -> bool:
    """Whether a safetensors shard can hold ``t`` (a ``DTensor``: its local shard): a dense
    strided tensor with real memory, of a dtype in :data:`gockpt.format.DTYPE_TO_CODE`.

    Others (sparse or complex tensors, unsigned 16-64-bit integers, quantized or meta
    tensors) are not tracked: they are copied where the state tree is taken, at the captured
    step, and stored in its pickled part, as ``torch.save`` stores them.
    """
    t = local(t)
    return (t.layout == torch.strided and t.dtype in DTYPE_TO_CODE and not t.is_quantized
            and t.device.type != "meta" and _dense(t))


def _dense(t: torch.Tensor) -> bool:
    """Whether ``t`` covers exactly ``numel`` distinct elements of its storage (any stride order)."""
    if t.is_contiguous():
        return True
    dims = sorted((st, sz) for st, sz in zip(t.stride(), t.shape, strict=True) if sz != 1)
    expect = 1
    for st, sz in dims:
        if st != expect:
            return False
        expect *= sz
    return True


def shared_parameters(optimizers: list[Optimizer]) -> bool:
    """Whether a parameter is in the param groups of more than one optimizer (or twice in one).

    :func:`build_layout` refuses such optimizers: a unit is one parameter with the state of
    the one optimizer that updates it. The adapters take those checkpoints whole at the request
    instead (mode ``async``).
    """
    return shared_parameter(optimizers) is not None


def shared_parameter(optimizers: list[Optimizer]) -> str | None:
    """Where a parameter is met a second time in ``optimizers``' param groups, in words for an
    error ("optimizer 1, parameter 0, shape (4, 3)"); None where each is in one place."""
    seen: set[int] = set()
    for oi, opt in enumerate(optimizers):
        pidx = 0
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) in seen:
                    return f"optimizer {oi}, parameter {pidx}, shape {tuple(p.shape)}"
                seen.add(id(p))
                pidx += 1
    return None


def shared_parameter_error(where: str) -> str:
    """The message for a parameter in two optimizers (or twice in one), found at ``where``."""
    return (f"a parameter is in the param groups of two optimizers, or twice in one ({where}): "
            "GoCkpt copies and replays each parameter with the state of the one optimizer that "
            "updates it; give each parameter to one optimizer, or checkpoint this model with "
            "torch.save / torch.distributed.checkpoint")


def build_layout(model: nn.Module, optimizers: list[Optimizer]) -> StateLayout:
    """Enumerate the tensors of a checkpoint of ``model`` and ``optimizers``.

    Call after the optimizers' state exists (after the first step); state created later is
    noticed through :attr:`StateLayout.signature`. A tensor the shards cannot hold
    (:func:`storable`) is left out, and so is a parameter whose optimizer state holds one
    (replay needs all of it): the state tree's copy at the captured step stores them.

    Raises:
        ValueError: a parameter owned by two optimizers.
        TypeError: such a tensor where only a shard could hold it: a sharded one (a DTensor,
            or the optimizer state of a DTensor parameter), or an optimizer parameter that is
            not in the model (no state tree holds its value).
    """
    sd = model.state_dict(keep_vars=True)
    canonical: dict[int, str] = {}
    aliases: dict[str, str] = {}
    model_keys: list[str] = []
    model_tensors: dict[str, torch.Tensor] = {}
    for k, v in sd.items():
        if not isinstance(v, torch.Tensor):
            continue
        model_keys.append(k)
        key = f"model.{k}"
        if id(v) in canonical:
            aliases[key] = canonical[id(v)]
            continue
        canonical[id(v)] = key
        model_tensors[key] = v

    units: list[Unit] = []
    owned: dict[int, Unit | None] = {}  # None: owned by an optimizer, left out (not storable)
    left_out: list[str] = []
    left_units: list[str] = []  # of those, parameters an optimizer updates
    for oi, opt in enumerate(optimizers):
        pidx = 0
        for gi, group in enumerate(opt.param_groups):
            for p in group["params"]:
                if id(p) in owned:
                    raise ValueError(shared_parameter_error(
                        f"optimizer {oi}, parameter {pidx}, shape {tuple(p.shape)}"))
                state = opt.state.get(p, {})
                found = canonical.get(id(p))
                if not storable(p) or not all(storable(t) for t in state.values() if isinstance(t, torch.Tensor)):
                    if found is None:
                        # Outside the model: no state tree holds its value (an optimizer's
                        # state_dict holds none), so only a shard could.
                        name, t = next((n, t) for n, t in [("value", p), *state.items()]
                                       if isinstance(t, torch.Tensor) and not storable(t))
                        raise TypeError(f"optimizer {oi}, parameter {pidx} (not in the model): its "
                                        f"{name} ({_kind(t)}) cannot be stored by GoCkpt")
                    owned[id(p)] = None
                    left_out.append(found)
                    left_units.append(found)
                    pidx += 1
                    continue
                if found is not None:
                    key = found
                else:
                    # An optimizer parameter outside the model: stored under the optimizer.
                    key = f"optim.{oi}.{pidx}.__param__"
                pe = _entry(key, p.detach())
                se = {
                    name: _entry(f"optim.{oi}.{pidx}.{name}", t.detach())
                    for name, t in state.items()
                    if isinstance(t, torch.Tensor)
                }
                u = Unit(oi, gi, pidx, p, pe, se)
                units.append(u)
                owned[id(p)] = u
                pidx += 1
    static = []
    for key, t in model_tensors.items():
        if id(t) in owned:
            continue
        if storable(t):
            static.append(_entry(key, t.detach()))
        else:
            left_out.append(key)
    layout = StateLayout(units, static, aliases, model_keys, left_out=tuple(left_out))
    if layout.sharded:
        # A sharded checkpoint keeps a plain model tensor left out (a complex rotary table, a
        # buffer every rank holds whole) in each part's state tree, whose model entries its
        # loaders read (gockpt.dcp). They read optimizer state from the shards only, and do not
        # assemble a DTensor from those trees: such tensors are refused.
        for key in left_out:
            t = model_tensors[key]
            if is_dtensor(t) or key in left_units:
                raise TypeError(f"tensor {key!r} ({_kind(t)}) cannot be stored in a sharded "
                                "checkpoint: a sharded tensor (DTensor), or a parameter an "
                                "optimizer updates, must be dense and of safetensors' dtypes, "
                                "and so must its optimizer state")
    layout.signature = layout_signature(model, optimizers)
    return layout


def layout_signature(model: nn.Module, optimizers: list[Optimizer],
                     model_sd: Mapping[str, Any] | None = None) -> tuple:
    """A cheap fingerprint of what :func:`build_layout` would enumerate.

    It covers the identity and storage of every tensor, so that ``optimizer.load_state_dict``
    (new state tensors) or ``module.to()`` (new parameter storage) makes the engine re-enumerate.
    A flat tuple: it is taken at every request, on the training thread, and the per-tensor
    tuples and sorts of a nested one cost more than the state_dict traversal. (A state dict
    whose names come in another order reads as changed: a rebuild, never a missed change.)
    ``model_sd``: ``model.state_dict(keep_vars=True)`` where the caller already took it.
    """
    sig: list = []
    add = sig.append
    for k, v in (model.state_dict(keep_vars=True) if model_sd is None else model_sd).items():
        add(k)
        if isinstance(v, torch.Tensor):
            add(id(v))
            add(_address(v))
    for opt in optimizers:
        add(None)  # where one optimizer ends
        state = opt.state
        for g in opt.param_groups:
            for p in g["params"]:
                add(id(p))
                add(_address(p))
                st = state.get(p)
                if st:
                    for k, v in st.items():
                        if isinstance(v, torch.Tensor):
                            add(k)
                            add(id(v))
                            add(_address(v))
                add(len(st) if st else 0)  # where one parameter's state ends
    return tuple(sig)


def _kind(t: torch.Tensor) -> str:
    t = local(t)
    return f"{t.dtype} {str(t.layout).replace('torch.', '')}"


def _address(t: torch.Tensor) -> int:
    # A sparse tensor has no data pointer; its identity is the signature's part for it.
    return local(t).data_ptr() if t.layout == torch.strided else 0
