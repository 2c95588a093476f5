"""CPU replay: bring host copies of optimizer-owned tensors forward by recorded updates.

GoCkpt §4.3: blocks copied in different steps hold different versions; applying the gradients
captured since a block was copied, with the optimizer's own update rule and the hyperparameters
that were in force at each step, brings every block to the same (latest) version. LowDiff §III-B
uses the same fact (gradients are differential checkpoints).

A backend updates host tensors in place. Shape legend: each parameter is any shape; its gradient
and per-parameter optimizer state tensors have the parameter's shape (``step`` is 0-dim).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from typing import Any, Protocol

import torch
from torch.optim import Optimizer

#: torch.optim classes whose state is per parameter and whose step is a pure function of
#: (param, grad, state, hyperparameters): replaying them on CPU tensors is exact when the CPU
#: kernels match the live ones (always, when training runs on CPU).
REPLAYABLE_TORCH_OPTIMIZERS: tuple[type[Optimizer], ...] = tuple(
    getattr(torch.optim, name)
    for name in (
        "SGD", "Adam", "AdamW", "Adagrad", "Adadelta", "Adamax", "RMSprop", "NAdam", "RAdam", "ASGD",
    )
    if hasattr(torch.optim, name)
)

# Keys of a param group that decide where and how a kernel runs, not what it computes; on CPU
# replay they must be the CPU-legal choice.
_DEVICE_ONLY_KEYS = ("capturable",)


class ReplayBackend(Protocol):
    """Applies one recorded optimizer update to host tensors, in place.

    Implementations: :class:`TorchReplay` (reference and fallback) and the native kernels in
    ``gockpt._native`` (issue: csrc).
    """

    name: str

    def supports(self, optimizer_cls: type[Optimizer], hparams: dict[str, Any]) -> bool:
        """Whether this backend can replay a group of ``optimizer_cls`` with ``hparams``."""
        ...

    def step(
        self,
        optimizer_cls: type[Optimizer],
        hparams: dict[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
    ) -> None:
        """Apply one update of one param group.

        Args:
            optimizer_cls: the live optimizer's class.
            hparams: the group's hyperparameters in force at that update (no ``"params"``).
            params: CPU tensors, updated in place.
            grads: CPU tensors, the gradients the live optimizer applied (same shapes).
            states: per-parameter optimizer state (CPU tensors, updated in place), as in
                ``optimizer.state[p]``.
        """
        ...


def is_replayable(optimizer: Optimizer) -> bool:
    """Whether the torch replay backend can replay ``optimizer`` exactly on CPU tensors.

    True for the built-in per-parameter ``torch.optim`` optimizers (not LBFGS, whose state
    spans all parameters and whose step calls the closure; not SparseAdam).
    """
    return type(optimizer) in REPLAYABLE_TORCH_OPTIMIZERS


def snapshot_hparams(group: dict[str, Any]) -> dict[str, Any]:
    """A deep copy of a param group without ``"params"`` (tensor values cloned to CPU)."""
    out: dict[str, Any] = {}
    for k, v in group.items():
        if k == "params":
            continue
        if isinstance(v, torch.Tensor):
            out[k] = v.detach().to("cpu", copy=True)
        else:
            out[k] = copy.deepcopy(v)
    return out


class TorchReplay:
    """Replays through the optimizer's own torch implementation on CPU tensors.

    A throw-away instance of the live optimizer's class is built over the host tensors with the
    recorded hyperparameters and stepped once: exactly the arithmetic the live optimizer runs
    when training on CPU (GoCkpt §4.3 uses the optimizer's own update rule).
    """

    name = "torch"

    def supports(self, optimizer_cls: type[Optimizer], hparams: dict[str, Any]) -> bool:
        return optimizer_cls in REPLAYABLE_TORCH_OPTIMIZERS

    def step(
        self,
        optimizer_cls: type[Optimizer],
        hparams: dict[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
    ) -> None:
        if not params:
            return
        group = dict(hparams)
        for k in _DEVICE_ONLY_KEYS:
            if group.get(k):
                group[k] = False
        if group.get("fused") and not _cpu_fused_ok(optimizer_cls):
            group["fused"] = False
        opt = optimizer_cls([{"params": list(params), **group}])  # type: ignore[call-arg]
        for p, g, st in zip(params, grads, states, strict=True):
            p.grad = g
            opt.state[p] = st
        try:
            with torch.no_grad():
                opt.step()
        finally:
            for p in params:
                p.grad = None


def _cpu_fused_ok(optimizer_cls: type[Optimizer]) -> bool:
    return optimizer_cls.__name__ in ("Adam", "AdamW", "SGD", "Adagrad")
