"""The compiled replay kernels (gockpt._native) against torch.optim and the torch backend.

The project installs with a C++ compiler, so a missing kernel fails these tests (it does not
skip them). Mixed-dtype gradients (bf16/fp16 gradients on fp32 parameters) are not something
torch.optim does; for them the reference is torch.optim stepped with the gradient upcast to
fp32 first, which is what the kernel computes (the upcast is exact).

Which kernel variant is exact depends on the CPU (torch's square root is MKL's, whose code
path follows the CPU's vendor; ATen's fused multiply-adds follow ATEN_CPU_CAPABILITY), so no
test names a variant: they assert that the variant the self-check picks is exact against the
live optimizer, and that on an x86-64 CPU running torch's MKL build one variant is exact.
Run them under ``ATEN_CPU_CAPABILITY=default`` / ``avx2`` / ``avx512`` to cover ATen's other
dispatch paths on one machine.
"""

from __future__ import annotations

import platform

import pytest
import torch
from torch.optim import SGD, Adam, AdamW, RMSprop

from gockpt import _native, selfcheck
from gockpt.replay import TorchReplay

SIZES = [1, 7, 1_000_003, (257, 129)]
STEPS = 3

ADAM_CASES = [
    (AdamW, {}),
    (AdamW, {"amsgrad": True, "maximize": True, "weight_decay": 0.1}),
    (Adam, {"weight_decay": 0.1}),
    (Adam, {"amsgrad": True, "maximize": True, "weight_decay": 0.05, "eps": 1e-6}),
    (AdamW, {"betas": (0.3, 0.95), "lr": torch.tensor(0.02)}),
    (Adam, {"betas": (0.8, 0.9), "lr": torch.tensor(0.01), "weight_decay": 0.0}),
]
SGD_CASES = [
    (SGD, {"lr": 0.1}),
    (SGD, {"lr": 0.1, "weight_decay": 0.01, "maximize": True}),
    (SGD, {"lr": 0.05, "momentum": 0.9, "dampening": 0.25}),
    (SGD, {"lr": 0.05, "momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    (SGD, {"lr": torch.tensor(0.05), "momentum": 0.5, "maximize": True}),
]


def _id(x):
    if isinstance(x, type):
        return x.__name__
    if isinstance(x, dict):
        return (
            ",".join(f"{k}={v.item() if isinstance(v, torch.Tensor) else v}" for k, v in x.items())
            or "defaults"
        )
    return str(x)


pytestmark = pytest.mark.usefixtures("one_thread_fresh_selfcheck")


def _data(sizes, steps, seed=0):
    gen = torch.Generator().manual_seed(seed)
    init = [torch.randn(s, generator=gen) for s in sizes]
    grads = []
    for _ in range(steps):
        step_grads = []
        for s in sizes:
            g = torch.randn(s, generator=gen) * torch.pow(
                10.0, torch.empty(s).uniform_(-12.0, 1.0, generator=gen)
            )
            g[torch.rand(s, generator=gen) < 0.05] = 0.0
            step_grads.append(g)
        grads.append(step_grads)
    return init, grads


def _lrs(lr, steps):
    # The learning rate changes every step, as under a scheduler.
    return [lr * (1.0 - 0.2 * k) for k in range(steps)]


def _live(cls, kw, init, grads, lrs):
    params = [t.clone() for t in init]
    opt = cls(params, **kw)
    for k, step_grads in enumerate(grads):
        for p, g in zip(params, step_grads, strict=True):
            p.grad = g.float()
        opt.param_groups[0]["lr"] = lrs[k]
        opt.step()
    return params, [opt.state[p] for p in params], opt


def _replayed(backend, cls, hparams, init, grads, lrs, grad_dtype=torch.float32):
    params = [t.clone() for t in init]
    states = [{} for _ in params]
    for k, step_grads in enumerate(grads):
        hp = dict(hparams, lr=lrs[k])
        backend.step(cls, hp, params, [g.to(grad_dtype) for g in step_grads], states)
    return params, states


def _assert_same(expected, got, exact, what):
    exp_params, exp_states = expected
    got_params, got_states = got
    for i, (a, b) in enumerate(zip(exp_params, got_params, strict=True)):
        _assert_tensor(a, b, exact, f"{what}: param {i}")
    for i, (es, gs) in enumerate(zip(exp_states, got_states, strict=True)):
        assert set(es) == set(gs), f"{what}: state keys of param {i}"
        for key in es:
            _assert_tensor(es[key], gs[key], exact, f"{what}: state[{i}][{key!r}]")


def _assert_tensor(a, b, exact, what):
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if exact:
        if not torch.equal(a, b):
            n = (a != b).sum().item()
            raise AssertionError(f"{what}: {n} of {a.numel()} elements differ")
    else:
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7, msg=what)


def _hparams(opt):
    group = dict(opt.param_groups[0])
    group.pop("params")
    return group


def test_kernel_is_built():
    assert _native.available(), (
        "gockpt._gockpt_native is not built: install with a C++ compiler (pip install -e .)"
    )
    assert _native.isas()[-1] == "portable"


@pytest.mark.parametrize(("cls", "kw"), ADAM_CASES + SGD_CASES, ids=_id)
def test_native_matches_torch_optim_and_torch_backend(cls, kw):
    lr0 = kw.get("lr", 1e-3)
    init, grads = _data(SIZES, STEPS)
    lrs = _lrs(lr0, STEPS)
    live_params, live_states, opt = _live(cls, kw, init, grads, lrs)
    expected = (live_params, [dict(s) for s in live_states])
    hparams = _hparams(opt)

    torch_got = _replayed(TorchReplay(), cls, hparams, init, grads, lrs)
    _assert_same(expected, torch_got, True, "torch backend")

    choice = selfcheck.select_backend(opt, "native")
    assert isinstance(choice.backend, _native.NativeReplay)
    native_got = _replayed(choice.backend, cls, hparams, init, grads, lrs)
    # The self-check's verdict holds on these larger tensors too: exact means bit for bit.
    _assert_same(expected, native_got, choice.exact, choice.backend.name)


# The kernel is built for the CPU optimizers as torch's x86-64 builds run them (MKL's square
# root, ATen's vectorized kernels); elsewhere no variant is promised to be exact.
_X86_MKL = platform.machine().lower() in ("x86_64", "amd64") and torch.backends.mkl.is_available()


@pytest.mark.skipif(not _X86_MKL, reason="exactness is promised for x86-64 torch builds with MKL")
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize(("cls", "kw"), [ADAM_CASES[0], ADAM_CASES[1], ADAM_CASES[2], SGD_CASES[3]], ids=_id)
def test_some_native_variant_is_exact_on_this_cpu(cls, kw, foreach):
    params = [torch.nn.Parameter(torch.randn(9)) for _ in range(2)]
    opt = cls(params, foreach=foreach, **kw)
    choice = selfcheck.select_backend(opt, "native")
    assert choice.exact, (
        f"no native variant reproduces {cls.__name__}(foreach={foreach}) on this CPU "
        f"({selfcheck._cpu_name()}, capability {torch.backends.cpu.get_cpu_capability()}): "
        f"{choice.candidates}; see gockpt/_native.py for the recipes per CPU"
    )
    # Both torch paths run the same elementwise kernels: the variant replays the other too.
    init, grads = _data([33, (17, 5)], STEPS, seed=7)
    lrs = _lrs(kw.get("lr", 1e-3), STEPS)
    for live_foreach in (False, True):
        live_params, live_states, _ = _live(cls, dict(kw, foreach=live_foreach), init, grads, lrs)
        got = _replayed(choice.backend, cls, _hparams(opt), init, grads, lrs)
        _assert_same((live_params, live_states), got, True, f"foreach={live_foreach}")


@pytest.mark.parametrize("grad_dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    ("cls", "kw"),
    [
        (AdamW, {"amsgrad": True}),
        (Adam, {"weight_decay": 0.1}),
        (SGD, {"lr": 0.1, "momentum": 0.9}),
    ],
    ids=_id,
)
def test_low_precision_grads_match_upcast_reference(cls, kw, grad_dtype):
    init, grads = _data(SIZES, STEPS, seed=1)
    grads = [[g.to(grad_dtype) for g in step] for step in grads]  # what the kernel receives
    lrs = _lrs(kw.get("lr", 1e-3), STEPS)
    live_params, live_states, opt = _live(cls, kw, init, grads, lrs)  # upcasts with .float()
    choice = selfcheck.select_backend(opt, "native")
    got = _replayed(choice.backend, cls, _hparams(opt), init, grads, lrs, grad_dtype=grad_dtype)
    _assert_same((live_params, live_states), got, choice.exact, f"{grad_dtype} grads")


def test_thread_count_and_instruction_set_do_not_change_bits():
    init, grads = _data([1_000_003, 9, (33, 17)], 2, seed=2)
    hp = _hparams(AdamW([torch.zeros(1)], amsgrad=True))
    lrs = _lrs(1e-3, 2)
    ref = _replayed(_native.NativeReplay(num_threads=1), AdamW, hp, init, grads, lrs)
    for threads in (2, 3, 8):
        got = _replayed(_native.NativeReplay(num_threads=threads), AdamW, hp, init, grads, lrs)
        _assert_same(ref, got, True, f"{threads} threads")
    small_init, small_grads = _data([10_007, 5], 2, seed=3)
    small_ref = _replayed(_native.NativeReplay(), AdamW, hp, small_init, small_grads, lrs)
    for isa in _native.isas():
        for fma in (True, False):
            backend = _native.NativeReplay(fma=fma, isa=isa)
            got = _replayed(backend, AdamW, hp, small_init, small_grads, lrs)
            if fma:
                _assert_same(small_ref, got, True, f"isa {isa}")
            else:  # unfused multiply-adds must actually round differently
                assert not torch.equal(small_ref[0][0], got[0][0]), f"isa {isa}: fma ignored"


def _sqrt(x, flavour, isa="auto"):
    from gockpt import _gockpt_native as ext

    out = torch.empty_like(x)
    ext.sqrt(x.numpy(), out.numpy(), flavour, isa)
    return out


def _sqrt_inputs():
    gen = torch.Generator().manual_seed(4)
    bits = torch.randint(0, 0x7F800000, (1 << 20,), generator=gen, dtype=torch.int32)
    specials = torch.tensor(
        [0.0, -0.0, float("inf"), 1e-45, 1e-40, 2.0**-102, 2.0**-103, 2.0**-126, 3.4e38,
         float.fromhex("0x1.ffep127"), float.fromhex("0x1.ffe002p127"), -1.0, float("-inf")]
    )
    return torch.cat([bits.view(torch.float32), torch.rand(1 << 16, generator=gen) * 1e-3, specials])


def _flavours():
    usable = _native.isas()
    return [f for f in _native.SQRT_FLAVOURS
            if f == "ieee" or (f == "mkl_avx512" and "avx512" in usable)
            or (f == "mkl_sse" and ("avx2" in usable or "avx512" in usable))]


def _same_sqrt(got, want):
    """Bit-identical, except that any NaN matches any NaN: MKL's sign and payload of the NaN it
    returns for a negative input differ between CPU vendors, and Adam never takes one."""
    nan = want.isnan()
    return torch.equal(got.isnan(), nan) and torch.equal(got[~nan].view(torch.int32),
                                                          want[~nan].view(torch.int32))


@pytest.mark.skipif(not _X86_MKL, reason="torch's sqrt is MKL's only in x86-64 builds with MKL")
def test_one_sqrt_flavour_is_torch_sqrt_on_this_cpu():
    x = _sqrt_inputs()
    want = x.sqrt()
    same = [f for f in _flavours() if _same_sqrt(_sqrt(x, f), want)]
    assert same, f"no sqrt flavour of {_flavours()} is torch.sqrt on {selfcheck._cpu_name()}"


@pytest.mark.parametrize("flavour", ["mkl_avx512", "mkl_sse"])
def test_mkl_sqrt_flavours_are_faithful_and_differ_from_ieee(flavour):
    if flavour not in _flavours():
        pytest.skip(f"{flavour} needs kernels this CPU cannot run ({_native.isas()})")
    x = _sqrt_inputs()
    got, ieee = _sqrt(x, flavour), _sqrt(x, "ieee")
    finite = x > 0
    ulps = (got[finite].view(torch.int32) - ieee[finite].view(torch.int32)).abs()
    assert int(ulps.max()) == 1  # faithful: never more than one ulp from the exact root
    assert torch.equal(got[x == 0], x[x == 0])  # signed zeros pass through
    assert torch.isnan(got[x < 0]).all()
    for isa in [i for i in _native.isas() if i != "portable"]:  # every lane width agrees
        if flavour != "mkl_avx512" or isa == "avx512":
            assert torch.equal(_sqrt(x, flavour, isa).view(torch.int32), got.view(torch.int32))


def test_sgd_first_step_creates_momentum_buffer_like_torch():
    init, grads = _data([7], 1, seed=5)
    params, states, _ = _live(SGD, {"lr": 0.1, "momentum": 0.9}, init, grads, [0.1])
    hp = _hparams(SGD([torch.zeros(1)], lr=0.1, momentum=0.9))
    got = _replayed(_native.NativeReplay(), SGD, hp, init, grads, [0.1])
    assert torch.equal(got[1][0]["momentum_buffer"], states[0]["momentum_buffer"])
    assert torch.equal(got[0][0], params[0])


def test_dense_non_contiguous_parameters_keep_their_layout():
    gen = torch.Generator().manual_seed(6)
    init = [torch.randn(33, 17, generator=gen).t()]  # dense, transposed strides
    grads = [[torch.randn(33, 17, generator=gen).t()], [torch.randn(17, 33, generator=gen)]]
    lrs = _lrs(1e-3, 2)
    live_params, live_states, opt = _live(AdamW, {}, init, grads, lrs)
    choice = selfcheck.select_backend(opt, "native")
    got = _replayed(choice.backend, AdamW, _hparams(opt), init, grads, lrs)
    assert got[0][0].stride() == init[0].stride()
    _assert_same((live_params, live_states), got, choice.exact, "transposed")


def test_supports_and_rejections():
    backend = _native.NativeReplay()
    adam_hp = _hparams(AdamW([torch.zeros(1)]))
    assert backend.supports(AdamW, adam_hp)
    assert not backend.supports(AdamW, dict(adam_hp, differentiable=True))
    assert not backend.supports(RMSprop, _hparams(RMSprop([torch.zeros(1)])))
    assert not _native.NativeReplay(recipe="cuda_foreach").supports(
        SGD, _hparams(SGD([torch.zeros(1)]))
    )
    with pytest.raises(ValueError, match="cannot replay"):
        backend.step(RMSprop, {"lr": 0.1}, [torch.zeros(2)], [torch.zeros(2)], [{}])
    with pytest.raises(TypeError, match="float32"):
        backend.step(AdamW, adam_hp, [torch.zeros(2, dtype=torch.float64)], [torch.zeros(2)], [{}])
    with pytest.raises(TypeError, match="grads"):
        backend.step(AdamW, adam_hp, [torch.zeros(2)], [torch.zeros(2, dtype=torch.int32)], [{}])
    with pytest.raises(ValueError, match="recipe"):
        _native.NativeReplay(recipe="nope")
    with pytest.raises(ValueError, match="mkl_sse"):
        _native.NativeReplay(sqrt="mkl_sse", isa="portable")
