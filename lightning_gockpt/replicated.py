"""``GoCkptIO`` under Lightning DDP with more than one process: the ranks share the write (issue 13).

Stock DDP dumps Lightning's dict on every rank and writes it from global rank 0 only. Under
``GoCkptIO`` every rank runs a :class:`gockpt.sharded.ShardedEngine` with ``replicated=True``
(:mod:`lightning_gockpt.sharded` builds it and installs the strategy's ``save_checkpoint``):
each rank copies, replays and writes a distinct share of the parameters with their optimizer
state, balanced by bytes (:mod:`gockpt.partition`), and rank 0 commits the parts as one
checkpoint (two-phase: no complete checkpoint unless every part is durable at one captured step).

What each part stores (:func:`part_state`, at the captured step, on every rank):

- ``state_dict`` and each of ``optimizer_states`` keep the entries of the rank's share (rank 0
  also keeps the buffers and every entry no rank's engine tracks, e.g. a tensor a hook added);
  the live tensors among them are references into the rank's own shards, any other tensor (a
  hook's edit, such as averaged weights) is copied by the rank that stores its key;
- rank 0's part alone holds the rest of Lightning's dict (loops, callbacks, schedulers, RNG
  state, hyperparameters ...: rank 0's dump, as stock saves it) and the order of the keys.

Loading (:func:`load`, from :meth:`GoCkptIO.load_checkpoint` on every rank under DDP, with any
number of processes, or in one process): every part is read and checked against the index
(:func:`gockpt.dcp.load_parts`), and the entries of ``state_dict`` and of each optimizer's
``state`` are joined in the order stock dumped them. The parts hold disjoint whole tensors, so
nothing is resharded; the result is the dict stock Lightning would load from its own file.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from typing import Any

import torch

from gockpt.errors import CheckpointCorruptError
from gockpt.partition import Partition, prune_model, prune_optimizer

__all__ = ["ORDER_KEY", "TENSOR_KEYS", "join", "load", "part_state"]

# Entries of Lightning's dict that hold the model's and optimizers' tensors: shared out by key.
TENSOR_KEYS = ("state_dict", "optimizer_states")
# Rank 0's part: the order of the keys of `state_dict` and of each optimizer's `state`.
ORDER_KEY = "lightning_order"


def part_state(checkpoint: Mapping[str, Any], part: Partition | None, rank: int) -> dict[str, Any]:
    """What rank ``rank``'s part stores of Lightning's dict ``checkpoint`` (the captured step's).

    Args:
        checkpoint: Lightning's dict as ``dump_checkpoint`` returned it on this rank.
        part: this rank's share (:attr:`gockpt.layout.StateLayout.partition` of the save).
        rank: this process's global rank.

    Returns:
        ``{"lightning": ...}``, plus, on rank 0, the key order under :data:`ORDER_KEY`.

    Raises:
        RuntimeError: no partition (the engine is not a replicated one).
    """
    if part is None:
        raise RuntimeError("gockpt: a DDP shared write needs a replicated ShardedEngine")
    out: dict[str, Any] = {}
    for key, value in checkpoint.items():  # stock's key order
        if key == "state_dict":
            out[key] = prune_model(value, part)
        elif key == "optimizer_states":
            out[key] = [prune_optimizer(sd, i, part) for i, sd in enumerate(value)]
        elif rank == 0:
            out[key] = value
    tree: dict[str, Any] = {"lightning": out}
    if rank == 0:
        tree[ORDER_KEY] = {
            "state_dict": list(checkpoint.get("state_dict", {})),
            "optimizer_states": [list(sd["state"]) for sd in checkpoint.get("optimizer_states", [])],
        }
    return tree


def load(path: str, *, verify: bool, allow_pickle: bool) -> dict[str, Any]:
    """Lightning's dict of the DDP checkpoint ``path`` (written with the ranks sharing the write).

    Args:
        path: the checkpoint directory (local).
        verify: check every part's manifest against the index and every file's size and
            checksum against its part's manifest.
        allow_pickle: unpickle arbitrary objects in the non-tensor state (trusted files only).

    Returns:
        The dict stock Lightning's DDP would have saved at the captured step: rank 0's
        non-tensor entries, ``state_dict`` and ``optimizer_states`` joined from the parts (CPU
        tensors).

    Raises:
        ValueError: a sharded checkpoint whose parts are shards, not shares (saved under
            ``ModelParallelStrategy``).
        gockpt.CheckpointCorruptError: a file that does not match its checksum, or parts that
            do not join into one dict (a key stored twice or by no part).
    """
    from gockpt.dcp import load_parts

    index, parts = load_parts(path, verify=verify, allow_pickle=allow_pickle)
    if not index.get("replicated"):
        raise ValueError(
            f"{path} is a sharded checkpoint of sharded tensors (saved under ModelParallelStrategy): "
            "resume it under ModelParallelStrategy (any number of processes), or assemble it with "
            "gockpt.dcp.load_full")
    return join([p.extra for p in parts], path)


def join(trees: list[Any], path: str = "") -> dict[str, Any]:
    """Lightning's dict from what each part stored (:func:`part_state` of every rank, in rank order).

    Raises:
        gockpt.CheckpointCorruptError: parts that do not join into one dict (a key stored twice
            or by no part, rank 0's entries or key order missing); the message names ``path``.
    """
    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}: {what}", path=path)

    for r, tree in enumerate(trees):
        if not isinstance(tree, dict) or not isinstance(tree.get("lightning"), dict):
            raise bad(f"part {r} holds no Lightning state (not written by GoCkptIO)")
    head, order = trees[0]["lightning"], trees[0].get(ORDER_KEY)
    if not (isinstance(order, dict) and isinstance(order.get("state_dict"), list)
            and isinstance(order.get("optimizer_states"), list)
            and len(order["optimizer_states"]) == len(head.get("optimizer_states", []))):
        raise bad(f"part 0 lacks {ORDER_KEY!r} or it does not match its optimizer_states")
    checkpoint = dict(head)
    if "state_dict" in head:
        dicts = [_entry(t["lightning"], "state_dict", bad) for t in trees]
        # Non-tensor entries (a module's extra state) are on every part: rank 0's are the ones.
        checkpoint["state_dict"] = _join(dicts, order["state_dict"], "state_dict", bad,
                                         keep=lambda r, v: r == 0 or isinstance(v, torch.Tensor))
    if "optimizer_states" in head:
        lists = [_entry(t["lightning"], "optimizer_states", bad) for t in trees]
        joined = []
        for i, sd in enumerate(head["optimizer_states"]):
            states = []
            for r, opts in enumerate(lists):
                if len(opts) != len(head["optimizer_states"]) or not isinstance(opts[i], dict):
                    raise bad(f"part {r}: optimizer_states do not match part 0's")
                states.append(_entry(opts[i], "state", bad))
            joined.append({**sd, "state": _join(states, order["optimizer_states"][i],
                                                f"optimizer_states[{i}].state", bad,
                                                keep=lambda r, v: True)})
        checkpoint["optimizer_states"] = joined
    return checkpoint


def _entry(tree: Mapping[str, Any], key: str, bad: Callable[[str], Exception]) -> Any:
    if key not in tree:
        raise bad(f"a part lacks {key!r}")
    return tree[key]


def _join(dicts: list[Any], order: list[Any], where: str, bad: Callable[[str], Exception], *,
          keep: Callable[[int, Any], bool]) -> Any:
    """The entries of every part's ``dicts[r]`` (each key in one part) in the order ``order``;
    of rank 0's mapping type (a state_dict's ``_metadata`` kept)."""
    found: dict[Any, Any] = {}
    for r, d in enumerate(dicts):
        if not isinstance(d, Mapping):
            raise bad(f"part {r}: {where} is a {type(d).__name__}, not a dict")
        for k, v in d.items():
            if not keep(r, v):
                continue
            if k in found:
                raise bad(f"{where}: {k!r} is stored by two parts")
            found[k] = v
    if set(found) != set(order):
        raise bad(f"{where}: the parts hold {sorted(map(str, set(found) ^ set(order)))[:5]} "
                  "unlike the order rank 0 recorded")
    out = copy.copy(dicts[0])  # keeps the type and its attributes (a state_dict's _metadata)
    out.clear()
    for k in order:
        out[k] = found[k]
    return out
