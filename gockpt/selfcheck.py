"""Start-up self-check: which CPU replay backend reproduces the live optimizer bit for bit.

GoCkpt §4.3 replays recorded gradients on host copies; a replayed block must equal the block
the live optimizer produced. Whether a backend manages that depends on rounding choices of
the kernels that ran the live step (FMA or not, the square root's implementation, the CUDA
formulas), which differ between devices, torch builds and CPUs. Rather than guess, the
self-check runs a short probe on a FRESH optimizer of the live optimizer's class, with the
live group-0 hyperparameters, on the live parameters' device, and the same probe through every
candidate backend on the CPU; it picks the fastest bit-exact candidate (timed on a tensor of
about a million elements, as replay runs on large blocks), else the closest one.

The probe: tensors of 1, 7, 33, 1029 and 16411 elements (odd tails for 8- and 16-lane
kernels), 4 steps, the learning rate changing every step, gradients spanning 19 orders of
magnitude with some exact zeros (square roots of zero, of subnormal and of tiny numbers), and
parameters spanning 9 orders of magnitude: where a parameter is small next to its update, a
one-ulp difference in the update's square root or division shows in the parameter's bits.
The live optimizer, its parameters and its state are only read (group 0's hyperparameters and
the parameters' device and dtype); results are cached per optimizer class, hyperparameters
that matter, device and dtype, so engines do not probe again.

Which variant of the native kernel is exact differs between CPUs (see :mod:`gockpt._native`:
torch's CPU square root is MKL's, whose code path depends on the CPU's vendor and instruction
sets; ATen's fused multiply-adds depend on ``ATEN_CPU_CAPABILITY``), which is why it is probed
rather than assumed. Each probe logs once which backend was chosen and why (INFO; WARNING when
no backend is bit-exact).
"""

from __future__ import annotations

import copy
import logging
import math
import platform
import threading
from collections.abc import Sequence
from dataclasses import dataclass, replace
from time import perf_counter
from typing import Any, cast

import torch
from torch.optim import Optimizer

from . import _native
from .config import REPLAY_BACKENDS
from .replay import ReplayBackend, TorchReplay, snapshot_hparams

__all__ = ["BackendChoice", "select_backend"]

logger = logging.getLogger(__name__)

_PROBE_SIZES = (1, 7, 33, 1029, 16411)
_PROBE_STEPS = 4
_TIMING_REPEATS = 3
_TIMING_NUMEL = (1 << 20) + 3
_PROBE_SEED = 20240917

_cache: dict[tuple, BackendChoice] = {}
_cache_lock = threading.Lock()


@dataclass(frozen=True)
class BackendChoice:
    """The replay backend chosen for one optimizer, with the evidence.

    Attributes:
        backend: the backend to replay with.
        exact: whether it reproduced the live optimizer's probe bit for bit (parameters and
            every state tensor after every probe step).
        max_abs_error: largest absolute difference on the probe; 0.0 when exact.
        candidates: backend name -> its max absolute error on the probe (``inf`` when it
            raised), for the checkpoint manifest.
        reason: one sentence saying why this backend was chosen (logged once per probe).
        replay_bytes_per_s: bytes of state (parameter and optimizer state) the chosen backend
            brought forward per second on the timing probe (one tensor of about a million
            elements, best of a few steps on an idle core: an upper bound on what the replay
            thread reaches while persist and copy share the cores); 0.0 when every candidate
            failed the probe or the timing step raised.
    """

    backend: ReplayBackend
    exact: bool
    max_abs_error: float
    candidates: dict[str, float]
    reason: str = ""
    replay_bytes_per_s: float = 0.0


def select_backend(optimizer: Optimizer, preference: str = "auto") -> BackendChoice:
    """Pick the replay backend for ``optimizer`` by probing (see the module docstring).

    Args:
        optimizer: the live optimizer; only its class, ``param_groups[0]``'s hyperparameters
            and its parameters' device and dtype are read.
        preference: ``"auto"`` (every available backend), ``"torch"`` (only
            :class:`gockpt.replay.TorchReplay`) or ``"native"`` (only the compiled kernels).

    Returns:
        The fastest bit-exact candidate, else the one with the smallest max absolute error.

    Raises:
        ValueError: ``preference`` is unknown; ``"native"`` is requested but the compiled
            kernel is not built or supports neither this optimizer nor its hyperparameters
            and dtype; or no backend can replay this optimizer.
    """
    if preference not in REPLAY_BACKENDS:
        raise ValueError(f"preference must be one of {REPLAY_BACKENDS}, got {preference!r}")
    cls = type(optimizer)
    group = optimizer.param_groups[0]
    params = list(group["params"])
    device = params[0].device if params else torch.device("cpu")
    dtype = params[0].dtype if params else torch.float32
    hparams = snapshot_hparams(group)
    native_ok = _native.available() if preference != "torch" else False
    key = (cls, _hparams_key(hparams), str(device), dtype, preference, native_ok)
    with _cache_lock:
        hit = _cache.get(key)
    if hit is not None:
        return hit
    candidates = _candidates(cls, hparams, dtype, preference, native_ok)
    choice = _probe(cls, group, device, dtype, hparams, candidates)
    if preference == "auto" and not native_ok:
        choice = replace(choice, reason=choice.reason + "; the native kernel is not built")
    logger.log(
        logging.INFO if choice.exact else logging.WARNING,
        "gockpt: CPU replay of %s (%s on %s) uses %s: %s (CPU %s, torch capability %s, "
        "native kernels %s; max abs error per candidate %s)",
        cls.__name__,
        dtype,
        device,
        choice.backend.name,
        choice.reason,
        _cpu_name(),
        torch.backends.cpu.get_cpu_capability(),
        _native.isas()[0] if native_ok else "not built",
        choice.candidates,
    )
    with _cache_lock:
        _cache.setdefault(key, choice)
    return choice


def _candidates(
    cls: type[Optimizer],
    hparams: dict[str, Any],
    dtype: torch.dtype,
    preference: str,
    native_ok: bool,
) -> list[ReplayBackend]:
    out: list[ReplayBackend] = []
    if preference in ("auto", "torch"):
        torch_backend = TorchReplay()
        if torch_backend.supports(cls, hparams):
            out.append(torch_backend)
    if preference in ("auto", "native"):
        if not native_ok:
            if preference == "native":
                raise ValueError(
                    "replay_backend='native' was requested but the compiled kernel "
                    "gockpt._gockpt_native is not available (install gockpt on a machine with a "
                    "C++ compiler, e.g. `pip install .`, or use replay_backend='auto'/'torch')"
                )
        elif dtype == torch.float32:
            out.extend(v for v in _native.variants() if v.supports(cls, hparams))
        if preference == "native" and not out:
            raise ValueError(
                f"replay_backend='native' was requested but the native kernel cannot replay "
                f"{cls.__name__} with parameters of dtype {dtype} and hyperparameters {hparams} "
                "(it handles float32 Adam, AdamW and SGD, not differentiable=True)"
            )
    if not out:
        raise ValueError(f"no replay backend can replay {cls.__name__} on the CPU")
    return out


def _probe(
    cls: type[Optimizer],
    group: dict[str, Any],
    device: torch.device,
    dtype: torch.dtype,
    hparams: dict[str, Any],
    candidates: Sequence[ReplayBackend],
) -> BackendChoice:
    gen = torch.Generator().manual_seed(_PROBE_SEED)
    init = [_spread(n, gen, -9.0, 0.0).to(dtype) for n in _PROBE_SIZES]
    grads = [[_probe_grad(n, gen).to(dtype) for n in _PROBE_SIZES] for _ in range(_PROBE_STEPS)]
    live_lr = group["lr"]
    lrs = [_scaled_lr(live_lr, 1.0 - 0.15 * k) for k in range(_PROBE_STEPS)]

    # The live probe: a fresh optimizer of the same class with the live group's settings.
    live_hp = {
        k: (v.detach().clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v))
        for k, v in group.items()
        if k != "params"
    }
    live_params = [t.to(device, copy=True) for t in init]
    opt = cast(Any, cls)([{"params": live_params, **live_hp}])
    expected = []
    for k in range(_PROBE_STEPS):
        for p, g in zip(live_params, grads[k], strict=True):
            p.grad = g.to(device, copy=True)
        opt.param_groups[0]["lr"] = lrs[k]
        with torch.no_grad():
            opt.step()
        expected.append(
            (
                [p.detach().cpu().clone() for p in live_params],
                [{n: _cpu_clone(v) for n, v in opt.state[p].items()} for p in live_params],
            )
        )
    del opt, live_params

    errors: dict[str, float] = {}
    for backend in candidates:
        params = [t.clone() for t in init]
        states: list[dict[str, Any]] = [{} for _ in params]
        err = 0.0
        try:
            for k in range(_PROBE_STEPS):
                backend.step(cls, dict(hparams, lr=_cpu_clone(lrs[k])), params, grads[k], states)
                err = max(err, _max_abs_diff(expected[k], params, states))
        except Exception as e:  # a candidate that cannot run this probe is not chosen
            logger.debug("gockpt: replay candidate %s failed the probe: %r", backend.name, e)
            err = math.inf
        errors[backend.name] = err

    best_err = min(errors.values())
    finalists = [b for b in candidates if errors[b.name] == best_err]
    timed: dict[str, tuple[float, int]] = {}
    if math.isfinite(best_err):
        # Every finalist is timed, the one alone too: its pace seeds the planner's replay rate
        # until the replay thread has timed real updates (gockpt.plan.replay_wait_s).
        timed = {b.name: _timed_or_never(b, cls, hparams, dtype, lrs[0]) for b in finalists}
        finalists.sort(key=lambda b: timed[b.name][0])
    chosen = finalists[0]
    # The reason compares the finalists whose timing ran (a failed one is ranked last).
    seconds = {name: t for name, (t, _) in timed.items() if t < math.inf}
    if len(seconds) < 2 or chosen.name not in seconds:
        seconds = {}
    pace = 0.0
    if chosen.name in timed and 0 < timed[chosen.name][0] < math.inf:
        pace = timed[chosen.name][1] / timed[chosen.name][0]
    return BackendChoice(
        backend=chosen,
        exact=best_err == 0.0,
        max_abs_error=best_err,
        candidates=errors,
        reason=_reason(chosen, best_err, errors, seconds),
        replay_bytes_per_s=pace,
    )


def _reason(
    chosen: ReplayBackend, best_err: float, errors: dict[str, float], seconds: dict[str, float]
) -> str:
    """Why ``chosen`` won, in one sentence for the log."""
    if best_err != 0.0:
        return (
            f"no candidate reproduces the live optimizer bit for bit; it is the closest (max abs "
            f"error {best_err:g}), so multi-step checkpoints may differ from a blocking save"
        )
    if len(seconds) > 1:
        others = ", ".join(
            f"{name} {seconds[name] / seconds[chosen.name]:.1f}x slower"
            for name in seconds
            if name != chosen.name
        )
        return f"bit-exact on the probe and the fastest of {len(seconds)} exact candidates ({others})"
    natives = {name: err for name, err in errors.items() if name.startswith("native:")}
    if chosen.name == "torch" and natives:
        closest = min(natives, key=lambda n: natives[n])
        return (
            "bit-exact on the probe; no native kernel variant is on this CPU (closest "
            f"{closest}, max abs error {natives[closest]:g})"
        )
    if len(errors) == 1:
        return "bit-exact on the probe, the only backend that replays this optimizer and dtype"
    return "bit-exact on the probe, the only exact candidate"


def _cpu_name() -> str:
    """The CPU's model name (Linux ``/proc/cpuinfo``), else ``platform.processor()``."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _timed_or_never(
    backend: ReplayBackend, cls: type[Optimizer], hparams: dict[str, Any], dtype: torch.dtype,
    lr: Any,
) -> tuple[float, int]:
    """:func:`_time_step`, or ``(inf, 0)`` where the timing step raises: a backend that passed
    the probe is still chosen on it, ranked last and with no pace."""
    try:
        return _time_step(backend, cls, hparams, dtype, lr)
    except Exception as e:  # noqa: BLE001 - the timing is advice, the probe decided
        logger.debug("gockpt: timing replay candidate %s failed: %r", backend.name, e)
        return math.inf, 0


def _time_step(
    backend: ReplayBackend,
    cls: type[Optimizer],
    hparams: dict[str, Any],
    dtype: torch.dtype,
    lr: Any,
) -> tuple[float, int]:
    """Best of a few timed steps on one block-sized tensor, seconds, and the bytes of state
    (the parameter and its optimizer state) each step brings forward: replay runs on blocks
    of many MB, so per-element cost decides, and the minimum filters out a busy machine's
    noise."""
    gen = torch.Generator().manual_seed(_PROBE_SEED + 1)
    params = [torch.randn(_TIMING_NUMEL, generator=gen).to(dtype)]
    grads = [torch.randn(_TIMING_NUMEL, generator=gen).to(dtype)]
    states: list[dict[str, Any]] = [{}]
    hp = dict(hparams, lr=_cpu_clone(lr))
    backend.step(cls, hp, params, grads, states)  # warm-up; creates the state
    best = math.inf
    for _ in range(_TIMING_REPEATS):
        t0 = perf_counter()
        backend.step(cls, hp, params, grads, states)
        best = min(best, perf_counter() - t0)
    state = sum(t.nbytes for st in states for t in st.values() if isinstance(t, torch.Tensor))
    return best, sum(p.nbytes for p in params) + state


def _spread(n: int, gen: torch.Generator, lo: float, hi: float) -> torch.Tensor:
    """Normal samples scaled by 10**U(lo, hi): magnitudes spanning many orders."""
    return torch.randn(n, generator=gen) * torch.pow(
        10.0, torch.empty(n).uniform_(lo, hi, generator=gen)
    )


def _probe_grad(n: int, gen: torch.Generator) -> torch.Tensor:
    g = _spread(n, gen, -18.0, 1.0)
    g[torch.rand(n, generator=gen) < 0.05] = 0.0
    return g


def _scaled_lr(lr: Any, factor: float) -> Any:
    if isinstance(lr, torch.Tensor):
        return (lr.detach() * factor).to(lr.dtype)
    return lr * factor


def _cpu_clone(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if isinstance(v, torch.Tensor) else copy.deepcopy(v)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` (same dtype and shape) hold the same bytes."""
    return torch.equal(a.reshape(-1).contiguous().view(torch.uint8),
                       b.reshape(-1).contiguous().view(torch.uint8))


def _max_abs_diff(
    expected: tuple[list[torch.Tensor], list[dict[str, Any]]],
    params: Sequence[torch.Tensor],
    states: Sequence[dict[str, Any]],
) -> float:
    """0.0 when params and every expected state entry are bit-equal, else the largest
    absolute difference (``inf`` for a missing entry, a dtype/shape mismatch or NaN)."""
    exp_params, exp_states = expected
    pairs = list(zip(exp_params, params, strict=True))
    for es, st in zip(exp_states, states, strict=True):
        for name, ev in es.items():
            if not isinstance(ev, torch.Tensor):
                continue
            got = st.get(name)
            if not isinstance(got, torch.Tensor):
                return math.inf
            pairs.append((ev, got))
    err = 0.0
    for a, b in pairs:
        if a.dtype != b.dtype or a.shape != b.shape:
            return math.inf
        if torch.equal(a, b) or _same_bits(a, b):  # NaN != NaN, yet the same bits are exact
            continue
        d = (a.double() - b.double()).abs().max().item()
        err = max(err, d if d > 0.0 else math.inf)  # NaN (or bits unequal at d == 0): inf
    return err


def _hparams_key(hparams: dict[str, Any]) -> tuple:
    # lr values change every step and do not decide the rounding; their type does.
    items = []
    for k, v in sorted(hparams.items()):
        if k in ("lr", "initial_lr"):
            items.append((k, str(v.dtype) if isinstance(v, torch.Tensor) else type(v).__name__))
        else:
            items.append((k, _key_value(v)))
    return tuple(items)


def _key_value(v: Any) -> Any:
    if isinstance(v, torch.Tensor):
        return (
            "tensor",
            str(v.dtype),
            tuple(v.shape),
            tuple(v.detach().cpu().reshape(-1).tolist()),
        )
    if isinstance(v, (list, tuple)):
        return tuple(_key_value(x) for x in v)
    if isinstance(v, dict):
        return tuple(sorted((str(k), _key_value(x)) for k, x in v.items()))
    try:
        hash(v)
    except TypeError:
        return repr(v)
    return v
