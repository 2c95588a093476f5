"""Partitioned engines: the ranks of a replicated run (DDP) share the write (issue 13).

Under DDP every rank holds the same parameters and optimizer state (plain tensors). A
:class:`gockpt.sharded.ShardedEngine` made with ``replicated=True`` gives each rank's engine
the layout :func:`partition_layout` returns: a distinct share of the units (a parameter with
its optimizer state, GoCkpt §4.2.2), balanced by bytes. Each rank then copies, replays (in the
multi-step modes, GoCkpt §4.3) and writes about 1/N of the state; buffers and parameters
without an optimizer (the *static* part) are stored by rank 0. The parts are committed
together like the parts of a sharded checkpoint; each stored tensor is whole (offsets 0,
global shape its own shape) and stored once, so ``gockpt.dcp`` loads it with any world size.

The partition is a pure function of the unit sizes: every rank computes the same one from
the same model and optimizers, without communicating.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .layout import StateLayout

__all__ = ["Partition", "balance", "partition_layout", "prune_model", "prune_optimizer"]


@dataclass(frozen=True)
class Partition:
    """Which part of a replicated state this rank stores.

    Attributes:
        rank: this rank (0-based) among ``world`` ranks.
        world: number of ranks sharing the write.
        owners: unit index in the full layout -> the rank that stores it.
        foreign_params: (optimizer index, parameter index) of the units other ranks store.
        foreign_keys: layout keys (``model.<fqn>`` and aliases) of other ranks' parameters.
        stored_keys: layout keys (and aliases) of the tensors this rank stores.
        stored_params: (optimizer index, parameter index) of the units this rank stores.
    """

    rank: int
    world: int
    owners: tuple[int, ...]
    foreign_params: frozenset[tuple[int, int]]
    foreign_keys: frozenset[str]
    stored_keys: frozenset[str]
    stored_params: frozenset[tuple[int, int]] = frozenset()


def balance(sizes: Sequence[int], world: int, base: Sequence[int] | None = None) -> list[int]:
    """Assign items of ``sizes`` (bytes) to ``world`` ranks, the largest first to the least loaded.

    Greedy longest-processing-time scheduling: the heaviest rank holds at most 4/3 of the
    optimum (plus one item). Ties go to the lower item index and the lower rank, so the result
    is the same on every rank.

    Args:
        sizes: bytes of each item.
        world: number of ranks (>= 1).
        base: bytes each rank holds already (e.g. rank 0's buffers); zeros when None.

    Returns:
        The owning rank of each item, ``len(sizes)`` ints in ``[0, world)``.

    Raises:
        ValueError: ``world < 1`` or ``base`` not of length ``world``.
    """
    if world < 1:
        raise ValueError(f"world must be >= 1, got {world}")
    loads = [0] * world if base is None else [int(b) for b in base]
    if len(loads) != world:
        raise ValueError(f"base has {len(loads)} loads for {world} ranks")
    owner = [0] * len(sizes)
    for i in sorted(range(len(sizes)), key=lambda i: (-sizes[i], i)):
        r = min(range(world), key=lambda r: (loads[r], r))
        owner[i] = r
        loads[r] += sizes[i]
    return owner


def partition_layout(layout: StateLayout, rank: int, world: int) -> StateLayout:
    """The share of ``layout`` that rank ``rank`` of ``world`` stores.

    Units are balanced by :attr:`gockpt.layout.Unit.state_bytes` with :func:`balance`, rank 0
    starting with the static part's bytes. The returned layout keeps ``layout``'s signature (so
    the engine rebuilds it when the tensors change) and records the :class:`Partition`.

    Raises:
        ValueError: ``layout`` holds ``DTensor`` shards (a sharded model: use the sharded engine
            without ``replicated``), or ``rank`` is not in ``[0, world)``.
    """
    if layout.sharded:
        raise ValueError("a replicated (partitioned) engine needs plain tensors; this model holds "
                         "DTensor shards (FSDP): use ShardedEngine without replicated=True")
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not in [0, {world})")
    static_bytes = sum(e.spec.nbytes for e in layout.static)
    owners = balance([u.state_bytes for u in layout.units], world,
                     [static_bytes] + [0] * (world - 1))
    mine = [u for u, r in zip(layout.units, owners, strict=True) if r == rank]
    foreign = [u for u, r in zip(layout.units, owners, strict=True) if r != rank]
    static = list(layout.static) if rank == 0 else []
    stored = {e.key for u in mine for e in u.entries}
    stored |= {e.key for e in static}
    aliases = {a: t for a, t in layout.aliases.items() if t in stored}
    foreign_keys = {u.param_entry.key for u in foreign}
    foreign_keys |= {a for a, t in layout.aliases.items() if t in foreign_keys}
    part = Partition(rank, world, tuple(owners),
                     frozenset((u.optimizer_index, u.param_index) for u in foreign),
                     frozenset(foreign_keys), frozenset(stored | set(aliases)),
                     frozenset((u.optimizer_index, u.param_index) for u in mine))
    model_keys = [k for k in layout.model_keys if f"model.{k}" in part.stored_keys]
    return StateLayout(mine, static, aliases, model_keys, layout.signature, partition=part,
                       left_out=layout.left_out)


def prune_model(state_dict: Mapping[str, Any], part: Partition) -> dict[str, Any]:
    """``state_dict`` (``model.state_dict()``) without the tensors other ranks store.

    Other ranks' parameters are left out; on ranks other than 0 so is every tensor this rank
    does not store (buffers, and tensors the layout does not know yet: rank 0 copies those).
    Non-tensor entries (extra state) are kept.
    """
    import torch

    out = copy.copy(state_dict)  # keeps the mapping's type and its _metadata
    for k, v in state_dict.items():
        if not isinstance(v, torch.Tensor):
            continue
        key = f"model.{k}"
        if key in part.foreign_keys or (part.rank != 0 and key not in part.stored_keys):
            del out[k]  # type: ignore[attr-defined]
    return out  # type: ignore[return-value]


def prune_optimizer(state_dict: Mapping[str, Any], opt_index: int, part: Partition) -> dict[str, Any]:
    """``optimizer.state_dict()`` without the per-parameter state of other ranks' units.

    The state of a parameter in no unit (left out of the layout: :func:`gockpt.layout.storable`)
    is kept by rank 0 only, as the tensors ``prune_model`` leaves to it. The parameter groups
    are kept whole (every rank's part holds them).
    """
    out = dict(state_dict)
    out["state"] = {i: st for i, st in state_dict["state"].items()
                    if (opt_index, i) in part.stored_params
                    or (part.rank == 0 and (opt_index, i) not in part.foreign_params)}
    return out
