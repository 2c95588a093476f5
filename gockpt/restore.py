"""Turn a stored checkpoint back into ``model.state_dict()`` / ``optimizer.state_dict()`` form."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.optim import Optimizer

from ._bounded import DEFAULT_STORAGE_TIMEOUT_S
from .errors import CheckpointCorruptError
from .load import read_checkpoint
from .snapshot import resolve


@dataclass
class LoadedState:
    """A checkpoint in the shapes PyTorch loads.

    Attributes:
        model_state_dict: key -> CPU tensor (or non-tensor extra state), the keys of
            ``model.state_dict()``.
        optimizer_state_dicts: one ``optimizer.state_dict()``-shaped dict per optimizer, with
            CPU tensors.
        extra: what ``state_fn`` returned at the captured step (None if none was given).
        manifest: the checkpoint's manifest (``meta`` holds requested and captured steps).
    """

    model_state_dict: dict[str, Any]
    optimizer_state_dicts: list[dict[str, Any]]
    extra: Any
    manifest: dict[str, Any]
    optimizer_params: dict[tuple[int, int], torch.Tensor] = field(default_factory=dict)
    """(optimizer index, parameter index) -> value of optimizer parameters outside the model."""

    @property
    def captured_step(self) -> int:
        """Optimizer updates applied to the stored state."""
        return int(self.manifest["meta"]["captured_step"])


def load_checkpoint(
    path: str,
    *,
    storage_options: Mapping[str, Any] | None = None,
    verify: bool = True,
    allow_pickle: bool = False,
    timeout_s: float | None = DEFAULT_STORAGE_TIMEOUT_S,
) -> LoadedState:
    """Load a GoCkpt checkpoint directory.

    Args:
        path: checkpoint directory (local path or fsspec URL).
        storage_options: passed to fsspec.
        verify: check file sizes and checksums.
        allow_pickle: unpickle arbitrary objects in the non-tensor state (trusted files only);
            by default only tensors, containers and primitives load.
        timeout_s: bound on one read call into a store that may hang, in seconds (see
            :func:`gockpt.load.read_checkpoint`).

    Returns:
        A :class:`LoadedState` with CPU tensors.

    Raises:
        FileNotFoundError: no complete checkpoint (no manifest) at ``path``.
        CheckpointCorruptError: a corrupt or inconsistent file, naming the file and key.
        CheckpointStorageError: a remote store failed while it was read
            (:class:`gockpt.CheckpointTimeoutError` where it timed out).
    """
    ck = read_checkpoint(path, storage_options=storage_options, verify=verify, allow_pickle=allow_pickle,
                         timeout_s=timeout_s)
    meta = ck.manifest["meta"]
    extra_file = ck.manifest["extra_file"]

    def bad(what: str) -> CheckpointCorruptError:
        return CheckpointCorruptError(f"{path}/{extra_file}: {what}", path=path)

    blob = ck.extra if isinstance(ck.extra, dict) else {}
    if "model" in blob:  # state trees with references to the shards (see gockpt.snapshot)
        return _from_trees(path, ck, blob, bad)
    if "optimizers" not in blob or "model_extra" not in blob:
        raise bad("non-tensor state lacks 'optimizers'/'model_extra'")
    if not isinstance(blob["model_extra"], dict):
        raise bad(f"'model_extra' is a {type(blob['model_extra']).__name__}, not a dict")
    if not isinstance(blob["optimizers"], list):
        raise bad(f"'optimizers' is a {type(blob['optimizers']).__name__}, not a list")
    model_keys = meta.get("model_keys", [])
    if not (isinstance(model_keys, list) and all(isinstance(k, str) for k in model_keys)):
        raise CheckpointCorruptError(
            f"{path}/manifest.json: meta key 'model_keys' is not a list of strings", path=path
        )
    model_sd: dict[str, Any] = {}
    for k in model_keys:
        key = f"model.{k}"
        if key not in ck.tensors:
            raise CheckpointCorruptError(
                f"{path}: tensor {key!r} listed in the manifest is missing", path=path
            )
        model_sd[k] = ck.tensors[key]
    model_sd.update(blob["model_extra"])
    opt_sds: list[dict[str, Any]] = []
    opt_params: dict[tuple[int, int], torch.Tensor] = {}
    for i, stripped in enumerate(blob["optimizers"]):
        where = f"optimizers[{i}]"
        if not (
            isinstance(stripped, dict)
            and isinstance(stripped.get("state"), dict)
            and isinstance(stripped.get("param_groups"), list)
        ):
            raise bad(f"{where} is not a dict with a 'state' dict and a 'param_groups' list")
        state: dict[int, dict[str, Any]] = {}
        for idx, st in stripped["state"].items():
            if isinstance(idx, bool) or not isinstance(idx, (int, str)) or not isinstance(st, dict):
                raise bad(f"{where}: state entry {idx!r} is malformed")
            try:
                state[int(idx)] = dict(st)
            except ValueError:
                raise bad(f"{where}: state key {idx!r} is not a parameter index") from None
        prefix = f"optim.{i}."
        for key, t in ck.tensors.items():
            if not key.startswith(prefix):
                continue
            idx_s, _, name = key[len(prefix):].partition(".")
            try:
                idx = int(idx_s)
            except ValueError:
                raise CheckpointCorruptError(
                    f"{path}: malformed optimizer key {key!r}", path=path
                ) from None
            if name == "__param__":
                opt_params[(i, idx)] = t
            else:
                state.setdefault(idx, {})[name] = t
        opt_sds.append({"state": dict(sorted(state.items())), "param_groups": stripped["param_groups"]})
    return LoadedState(model_sd, opt_sds, blob.get("user"), ck.manifest, opt_params)


def _from_trees(path: str, ck: Any, blob: dict[str, Any], bad: Any) -> LoadedState:
    if not isinstance(blob["model"], dict):
        raise bad(f"'model' is a {type(blob['model']).__name__}, not a dict")
    if not isinstance(blob.get("optimizers"), list):
        raise bad(f"'optimizers' is a {type(blob.get('optimizers')).__name__}, not a list")
    model_sd = resolve(blob["model"], ck.tensors, path)
    opt_sds = [resolve(sd, ck.tensors, path) for sd in blob["optimizers"]]
    for i, sd in enumerate(opt_sds):
        if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or "param_groups" not in sd:
            raise bad(f"optimizer {i}'s state is not an optimizer state_dict")
    opt_params: dict[tuple[int, int], torch.Tensor] = {}
    for key, t in ck.tensors.items():
        parts = key.split(".")
        if len(parts) == 4 and parts[0] == "optim" and parts[3] == "__param__" \
                and parts[1].isdigit() and parts[2].isdigit():
            opt_params[(int(parts[1]), int(parts[2]))] = t
    return LoadedState(dict(model_sd), opt_sds, resolve(blob.get("user"), ck.tensors, path),
                       ck.manifest, opt_params)


def load_into(model: nn.Module, optimizers: Sequence[Optimizer], state: LoadedState) -> None:
    """Load ``state`` into a live model and its optimizers.

    Everything is checked before anything is written: a checkpoint that does not fit leaves the
    model and the optimizers untouched.

    Raises:
        ValueError: a tensor whose shape or dtype does not fit the model, a missing or unexpected
            key (the message names the key); a different number of optimizers, or an optimizer
            whose stored state has a different number of parameter groups or of parameters in
            a group than the live one, or is not an optimizer ``state_dict`` (the message names
            the optimizer's index and the group).
    """
    live = model.state_dict()
    for k, v in state.model_state_dict.items():
        if k not in live:
            raise ValueError(f"checkpoint tensor {k!r} is not in the model")
        lv = live[k]
        if isinstance(v, torch.Tensor) and isinstance(lv, torch.Tensor):
            if v.shape != lv.shape or v.dtype != lv.dtype:
                raise ValueError(
                    f"checkpoint tensor {k!r} is {v.dtype}{list(v.shape)} but the model has "
                    f"{lv.dtype}{list(lv.shape)}")
    missing = [k for k in live if k not in state.model_state_dict]
    if missing:
        raise ValueError(f"checkpoint lacks model keys {missing[:5]}")
    if len(optimizers) != len(state.optimizer_state_dicts):
        raise ValueError(
            f"checkpoint has {len(state.optimizer_state_dicts)} optimizers, the model {len(optimizers)}")
    for i, (opt, sd) in enumerate(zip(optimizers, state.optimizer_state_dicts, strict=True)):
        _check_optimizer_fits(i, opt, sd)
    outside = {}
    for (oi, idx), v in state.optimizer_params.items():
        if not 0 <= oi < len(optimizers):
            raise ValueError(f"checkpoint parameter optim.{oi}.{idx}: no optimizer {oi}")
        params = [p for g in optimizers[oi].param_groups for p in g["params"]]
        if idx >= len(params) or params[idx].shape != v.shape or params[idx].dtype != v.dtype:
            raise ValueError(f"checkpoint parameter optim.{oi}.{idx} does not fit optimizer {oi}")
        outside[(oi, idx)] = (params[idx], v)
    model.load_state_dict(state.model_state_dict)
    with torch.no_grad():
        for p, v in outside.values():
            p.copy_(v)
    for opt, sd in zip(optimizers, state.optimizer_state_dicts, strict=True):
        opt.load_state_dict(sd)


def _check_optimizer_fits(i: int, opt: Optimizer, sd: Any) -> None:
    """What ``Optimizer.load_state_dict`` refuses, checked before anything is loaded: the
    number of parameter groups and the number of parameters in each.

    Raises:
        ValueError: naming optimizer ``i`` (and the group).
    """
    groups = sd.get("param_groups") if isinstance(sd, dict) else None
    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(groups, list)
            and all(isinstance(g, dict) and isinstance(g.get("params"), list) for g in groups)):
        raise ValueError(f"checkpoint optimizer {i}: not an optimizer state_dict (a 'state' dict "
                         "and a 'param_groups' list of groups with 'params' lists)")
    if len(groups) != len(opt.param_groups):
        raise ValueError(f"checkpoint optimizer {i} has {len(groups)} parameter group(s), the "
                         f"live optimizer {i} has {len(opt.param_groups)}")
    for g, (saved, group) in enumerate(zip(groups, opt.param_groups, strict=True)):
        if len(saved["params"]) != len(group["params"]):
            raise ValueError(f"checkpoint optimizer {i}, parameter group {g}: "
                             f"{len(saved['params'])} parameter(s), the live optimizer's group "
                             f"has {len(group['params'])}")
