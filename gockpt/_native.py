"""The compiled CPU replay kernels (``csrc/``) as :class:`gockpt.replay.ReplayBackend` objects.

GoCkpt §4.3 brings host copies of blocks forward by applying the recorded gradients with the
optimizer's update rule, with several threads. :class:`NativeReplay` does it for
``torch.optim.Adam``, ``AdamW`` and ``SGD`` in one fused, multi-threaded SIMD pass per
element, reproducing torch's rounding bit for bit when its variant matches the kernels that
ran the live step:

- ``recipe``: whose elementwise formulas to follow: ``"aten_cpu"`` (torch's CPU kernels,
  single-tensor and foreach alike), ``"cuda_foreach"``, ``"cuda_single"`` (ATen's CUDA
  kernels; untested on a GPU here, so only ever chosen when the self-check finds them exact).
- ``fma``: whether the multiply-adds that ATen's AVX2/AVX-512 kernels fuse (lerp, addcmul,
  add with alpha) are fused; ``False`` matches ``ATEN_CPU_CAPABILITY=default``.
- ``sqrt``: ``"ieee"`` (correctly rounded), ``"mkl_avx512"`` (the faithful square root that
  MKL's ``vsSqrt`` computes on AVX-512 Intel CPUs) or ``"mkl_sse"`` (MKL's generic SSE path,
  which ``vsSqrt`` runs on CPUs that are not Intel: a 12-bit ``RSQRTPS`` estimate and two
  Newton steps without FMA, also faithful only). torch's CPU build computes ``Tensor.sqrt`` of
  float32 with MKL's ``vsSqrt`` whatever ``ATEN_CPU_CAPABILITY`` says, so the square root
  follows the CPU's vendor and MKL's code path, while the fused multiply-adds follow ATen's
  dispatch (``fma=False`` under ``ATEN_CPU_CAPABILITY=default``).

Which variant reproduces ``torch.optim`` (torch 2.13 CPU, MKL 2024.2; Adam/AdamW foreach or
not; SGD has no square root, ``aten_cpu`` + FMA, or no FMA under the ``default`` capability):

========================================  ==========================================
CPU (MKL's ``vsSqrt`` kernel)              exact variant
========================================  ==========================================
Intel with AVX-512 (``Z0``)                ``aten_cpu`` + FMA + ``mkl_avx512``
Intel with AVX2 only (``L9``)              ``aten_cpu`` + FMA + ``ieee``
AMD EPYC / Ryzen, any ISA (``EX``)         ``aten_cpu`` + FMA + ``mkl_sse``
========================================  ==========================================

The Intel rows were measured on an AVX-512 Xeon (the AVX2 row with
``MKL_ENABLE_INSTRUCTIONS=AVX2``); the AMD row on an AMD EPYC (Zen 3, AVX2), where
``MKL_ENABLE_INSTRUCTIONS`` does not change MKL's choice. ``RSQRTPS`` tables differ between
vendors, so ``mkl_sse`` uses the running CPU's own instruction. ``fused=True`` on the CPU is
not reproduced: ATen's fused kernel computes the few elements past its last full vector in
double precision.

:func:`gockpt.selfcheck.select_backend` decides which variant is exact for a given optimizer.
Without the compiled module (no compiler at install time), :func:`available` is ``False``,
one INFO message says so, and replay uses :class:`gockpt.replay.TorchReplay`.

Shape legend: a parameter is any shape; its gradient and state tensors have its shape and
memory layout; ``state["step"]`` is a 0-dim tensor. Parameters and state are float32 CPU
tensors; gradients are float32, float16 or bfloat16 CPU tensors (widened exactly to float32
inside the kernel).
"""

from __future__ import annotations

import importlib
import logging
from collections.abc import Sequence
from typing import Any

import torch
from torch.optim import SGD, Adam, AdamW, Optimizer

_ext: Any
_import_error: ImportError | None
try:
    _ext = importlib.import_module("gockpt._gockpt_native")
except ImportError as e:  # built without a compiler: the torch backend takes over
    _ext, _import_error = None, e
else:
    _import_error = None

__all__ = ["NativeReplay", "available", "isas", "variants"]

logger = logging.getLogger(__name__)

_reported_missing = False

RECIPES = ("aten_cpu", "cuda_foreach", "cuda_single")
SQRT_FLAVOURS = ("ieee", "mkl_avx512", "mkl_sse")


def available() -> bool:
    """Whether the compiled kernel module ``gockpt._gockpt_native`` could be imported.

    The first call that finds it missing logs one INFO message (replay then uses the torch
    backend).
    """
    global _reported_missing
    if _ext is None and not _reported_missing:
        _reported_missing = True
        logger.info(
            "gockpt: native replay kernel not built (%s); CPU replay uses the torch backend",
            _import_error,
        )
    return _ext is not None


def isas() -> list[str]:
    """Instruction sets whose kernels this CPU runs, best first (``[]`` without the module)."""
    return list(_ext.isas()) if available() else []


def variants(num_threads: int | None = None) -> list[NativeReplay]:
    """Every kernel variant this machine can run (``[]`` without the module).

    Args:
        num_threads: threads per replay call for each variant (``None``: torch's intra-op
            thread count at each call).
    """
    if not available():
        return []
    usable = _ext.isas()
    sqrts = ["ieee"]
    if "avx512" in usable:
        sqrts.append("mkl_avx512")
    if "avx2" in usable or "avx512" in usable:
        sqrts.append("mkl_sse")
    out = []
    for recipe in RECIPES:
        for fma in (True, False):
            for sqrt in sqrts:
                if recipe != "aten_cpu" and (not fma or sqrt != "ieee"):
                    continue  # CUDA kernels fuse multiply-adds and take IEEE square roots
                out.append(NativeReplay(recipe=recipe, fma=fma, sqrt=sqrt, num_threads=num_threads))
    return out


class NativeReplay:
    """Replays Adam, AdamW and SGD updates with the compiled kernels, in place on CPU tensors.

    Scalars (bias corrections, step sizes, weight-decay factors) are computed in Python with
    the very expressions of torch 2.x's ``_single_tensor_adam`` / ``_single_tensor_sgd`` (so a
    tensor ``lr`` rounds as it does there); the kernel converts them to float32 as ATen
    converts a ``Scalar``. Per-element math follows the variant (see the module docstring).

    Args:
        recipe: one of ``"aten_cpu"``, ``"cuda_foreach"``, ``"cuda_single"``.
        fma: fuse the multiply-adds ATen's vectorized kernels fuse.
        sqrt: ``"ieee"``, ``"mkl_avx512"`` (needs an AVX-512 CPU) or ``"mkl_sse"`` (needs the
            avx2 or avx512 kernels).
        num_threads: threads per call; ``None``: ``torch.get_num_threads()`` at each call.
        isa: ``"auto"`` (best for this CPU), ``"avx512"``, ``"avx2"`` or ``"portable"``.

    Raises:
        RuntimeError: the compiled module is missing.
        ValueError: an unknown recipe or sqrt flavour, or one this CPU cannot run.
    """

    def __init__(
        self,
        *,
        recipe: str = "aten_cpu",
        fma: bool = True,
        sqrt: str = "ieee",
        num_threads: int | None = None,
        isa: str = "auto",
    ) -> None:
        if not available():
            raise RuntimeError(f"gockpt native replay kernel is not built: {_import_error}")
        if recipe not in RECIPES:
            raise ValueError(f"recipe must be one of {RECIPES}, got {recipe!r}")
        if sqrt not in SQRT_FLAVOURS:
            raise ValueError(f"sqrt must be one of {SQRT_FLAVOURS}, got {sqrt!r}")
        usable = _ext.isas()
        if isa != "auto" and isa not in usable:
            raise ValueError(f"isa {isa!r} is not usable on this CPU (usable: {usable})")
        chosen = usable[0] if isa == "auto" else isa
        if sqrt == "mkl_avx512" and chosen != "avx512":
            raise ValueError(f"sqrt='mkl_avx512' needs the avx512 kernels, isa is {chosen!r}")
        if sqrt == "mkl_sse" and chosen == "portable":
            raise ValueError("sqrt='mkl_sse' needs the avx2 or avx512 kernels, isa is 'portable'")
        if num_threads is not None and num_threads < 1:
            raise ValueError(f"num_threads must be >= 1 or None, got {num_threads}")
        self.recipe = recipe
        self.fma = fma
        self.sqrt = sqrt
        self.num_threads = num_threads
        self.isa = chosen
        self.name = f"native:{recipe}-{'fma' if fma else 'nofma'}-{sqrt}"

    def __repr__(self) -> str:
        return f"NativeReplay({self.name}, isa={self.isa}, num_threads={self.num_threads})"

    def supports(self, optimizer_cls: type[Optimizer], hparams: dict[str, Any]) -> bool:
        """Whether this variant can replay a group of ``optimizer_cls`` with ``hparams``.

        True for exactly ``torch.optim.Adam``/``AdamW`` (any recipe and sqrt flavour) and
        ``SGD`` (``"aten_cpu"`` with IEEE sqrt: SGD has no square root and the same rounding on
        CPU and CUDA), unless ``differentiable`` is set or a hyperparameter is a tensor that
        requires grad.
        """
        if hparams.get("differentiable", False):
            return False
        for v in hparams.values():
            vals = v if isinstance(v, (tuple, list)) else (v,)
            if any(
                isinstance(x, torch.Tensor) and (x.requires_grad or x.numel() != 1) for x in vals
            ):
                return False
        if optimizer_cls in (Adam, AdamW):
            return "betas" in hparams and "lr" in hparams
        if optimizer_cls is SGD:
            return self.recipe == "aten_cpu" and self.sqrt == "ieee" and "lr" in hparams
        return False

    def step(
        self,
        optimizer_cls: type[Optimizer],
        hparams: dict[str, Any],
        params: Sequence[torch.Tensor],
        grads: Sequence[torch.Tensor],
        states: Sequence[dict[str, torch.Tensor]],
    ) -> None:
        """Apply one update of one param group in place (see ``ReplayBackend.step``).

        Empty states are initialized as torch does at a first step (``step`` = 0, zero
        moments; SGD's momentum buffer becomes a copy of the gradient).

        Raises:
            ValueError: ``supports`` is False, lengths differ, or a tensor is not dense with
                its parameter's layout.
            TypeError: a parameter or state tensor is not float32 on the CPU, or a gradient
                is not float32/float16/bfloat16 on the CPU.
        """
        if not self.supports(optimizer_cls, hparams):
            raise ValueError(f"{self.name} cannot replay {optimizer_cls.__name__} with {hparams}")
        if not (len(params) == len(grads) == len(states)):
            raise ValueError("params, grads and states must have equal lengths")
        if not params:
            return
        threads = self.num_threads or torch.get_num_threads()
        if optimizer_cls is SGD:
            self._sgd(hparams, params, grads, states, threads)
        else:
            self._adam(optimizer_cls, hparams, params, grads, states, threads)

    def _adam(self, optimizer_cls, hparams, params, grads, states, threads) -> None:
        # Scalar math transcribed from torch/optim/adam.py (_single_tensor_adam, the
        # capturable=False branch), so floats stay Python doubles and tensors stay tensors.
        lr = _squeeze(hparams["lr"])
        beta1, beta2 = (_squeeze(b) for b in hparams["betas"])
        weight_decay = hparams.get("weight_decay", 0.0)
        eps = hparams.get("eps", 1e-8)
        amsgrad = bool(hparams.get("amsgrad", False))
        maximize = bool(hparams.get("maximize", False))
        decoupled = bool(hparams.get("decoupled_weight_decay", optimizer_cls is AdamW))
        wd_mode = "none" if weight_decay == 0 else ("decoupled" if decoupled else "coupled")
        ps, gs, ms, vs, vmaxs, coefs = [], [], [], [], [], []
        for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
            _check_param(p, i)
            if len(st) == 0:
                st["step"] = torch.tensor(0.0, dtype=_scalar_dtype())
                st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                if amsgrad:
                    st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            step_t = st["step"]
            step_t += 1
            step = step_t.item()
            wd = 0.0
            if weight_decay != 0:
                wd = (1 - lr * weight_decay) if decoupled else weight_decay
            if isinstance(beta1, torch.Tensor):
                w = 1 - beta1.to(dtype=p.dtype)
            else:
                w = 1 - beta1
            bias_correction1 = 1 - beta1**step
            bias_correction2 = 1 - beta2**step
            step_size = lr / bias_correction1
            bias_correction2_sqrt = bias_correction2**0.5
            coefs.append(
                (
                    float(wd),
                    float(w),
                    float(beta2),
                    float(1 - beta2),
                    float(bias_correction2_sqrt),
                    float(eps),
                    float(-step_size),
                )
            )
            ps.append(_flat(p, p, f"params[{i}]"))
            gs.append(_grad_array(g, p, i))
            ms.append(_flat(st["exp_avg"], p, f"exp_avg[{i}]"))
            vs.append(_flat(st["exp_avg_sq"], p, f"exp_avg_sq[{i}]"))
            if amsgrad:
                vmaxs.append(_flat(st["max_exp_avg_sq"], p, f"max_exp_avg_sq[{i}]"))
        _ext.adam_step(
            ps,
            gs,
            ms,
            vs,
            vmaxs,
            coefs,
            fma=self.fma,
            sqrt=self.sqrt,
            recipe=self.recipe,
            amsgrad=amsgrad,
            maximize=maximize,
            weight_decay=wd_mode,
            num_threads=threads,
            isa=self.isa,
        )

    def _sgd(self, hparams, params, grads, states, threads) -> None:
        # Scalar math transcribed from torch/optim/sgd.py (_single_tensor_sgd).
        lr = _squeeze(hparams["lr"])
        weight_decay = hparams.get("weight_decay", 0.0)
        momentum = hparams.get("momentum", 0.0)
        dampening = hparams.get("dampening", 0.0)
        nesterov = bool(hparams.get("nesterov", False))
        maximize = bool(hparams.get("maximize", False))
        has_momentum = momentum != 0
        ps, gs, bufs, inits, coefs = [], [], [], [], []
        for i, (p, g, st) in enumerate(zip(params, grads, states, strict=True)):
            _check_param(p, i)
            ps.append(_flat(p, p, f"params[{i}]"))
            gs.append(_grad_array(g, p, i))
            coefs.append((float(weight_decay), float(momentum), float(1 - dampening), float(-lr)))
            if has_momentum:
                buf = st.get("momentum_buffer")
                inits.append(buf is None)
                if buf is None:
                    buf = torch.empty_like(p, memory_format=torch.preserve_format)
                    st["momentum_buffer"] = buf
                bufs.append(_flat(buf, p, f"momentum_buffer[{i}]"))
        _ext.sgd_step(
            ps,
            gs,
            bufs,
            inits,
            coefs,
            fma=self.fma,
            maximize=maximize,
            weight_decay=bool(weight_decay != 0),
            momentum=bool(has_momentum),
            nesterov=nesterov,
            num_threads=threads,
            isa=self.isa,
        )


def _squeeze(x: Any) -> Any:
    # torch.optim.optimizer._to_scalar: 1-element tensors become 0-dim, floats stay floats.
    if isinstance(x, torch.Tensor) and x.dim() != 0:
        return x.squeeze()
    return x


def _scalar_dtype() -> torch.dtype:
    return torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32


def _check_param(p: torch.Tensor, i: int) -> None:
    if p.dtype != torch.float32 or p.device.type != "cpu":
        raise TypeError(f"params[{i}] must be a float32 CPU tensor, got {p.dtype} on {p.device}")


def _is_dense(t: torch.Tensor) -> bool:
    # Non-overlapping and dense: some permutation of the dims is contiguous.
    expected = 1
    for size, stride in sorted(zip(t.shape, t.stride(), strict=True), key=lambda s: s[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def _flat(t: torch.Tensor, like: torch.Tensor, what: str):
    """A 1-D numpy view of ``t``'s memory, in the element order of ``like``'s memory."""
    if t.dtype != torch.float32 or t.device.type != "cpu":
        raise TypeError(f"{what} must be a float32 CPU tensor, got {t.dtype} on {t.device}")
    if t.shape != like.shape:
        raise ValueError(f"{what} has shape {tuple(t.shape)}, expected {tuple(like.shape)}")
    if t.is_contiguous() and like.is_contiguous():
        return t.detach().view(-1).numpy()
    if t.stride() != like.stride() or not _is_dense(t):
        raise ValueError(f"{what} must be dense with the parameter's strides {like.stride()}")
    return t.detach().as_strided((t.numel(),), (1,)).numpy()


def _grad_array(g: torch.Tensor, p: torch.Tensor, i: int):
    if g.device.type != "cpu" or g.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(
            f"grads[{i}] must be a float32/float16/bfloat16 CPU tensor, got {g.dtype} on {g.device}"
        )
    if g.shape != p.shape:
        raise ValueError(f"grads[{i}] has shape {tuple(g.shape)}, expected {tuple(p.shape)}")
    g = g.detach()
    if not (g.is_contiguous() and p.is_contiguous()) and (
        g.stride() != p.stride() or not _is_dense(g)
    ):
        g = torch.empty_like(p, dtype=g.dtype).copy_(g)  # the parameter's layout; exact
    flat = g.view(-1) if g.is_contiguous() else g.as_strided((g.numel(),), (1,))
    if flat.dtype == torch.bfloat16:
        flat = flat.view(torch.int16)  # numpy has no bfloat16: the kernel reads int16 as bf16
    return flat.numpy()
