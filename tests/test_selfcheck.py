"""The start-up self-check (gockpt.selfcheck): probing, choice, cache, fallback without kernel."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.optim import SGD, AdamW, RMSprop

from gockpt import _native, selfcheck
from gockpt.replay import TorchReplay, snapshot_hparams

pytestmark = pytest.mark.usefixtures("one_thread_fresh_selfcheck")


def _trained(cls, steps=2, **kw):
    gen = torch.Generator().manual_seed(0)
    params = [
        torch.nn.Parameter(torch.randn(5, 3, generator=gen)),
        torch.nn.Parameter(torch.randn(7, generator=gen)),
    ]
    opt = cls(params, **kw)
    for _ in range(steps):
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return opt


class _Perturbed:
    """A backend that replays like torch, then moves every parameter by ``delta``."""

    def __init__(self, name, delta):
        self.name = name
        self.delta = delta

    def supports(self, optimizer_cls, hparams):
        return True

    def step(self, optimizer_cls, hparams, params, grads, states):
        TorchReplay().step(optimizer_cls, hparams, params, grads, states)
        for p in params:
            p.add_(self.delta)


def test_cpu_adamw_gets_an_exact_backend_native_where_a_variant_matches(caplog):
    caplog.set_level(logging.INFO, logger="gockpt.selfcheck")
    choice = selfcheck.select_backend(_trained(AdamW))
    assert choice.exact and choice.max_abs_error == 0.0
    assert choice.candidates["torch"] == 0.0
    assert choice.candidates[choice.backend.name] == 0.0
    exact_natives = [n for n, e in choice.candidates.items() if n.startswith("native:") and e == 0.0]
    if exact_natives:  # which variant matches differs per CPU; when one does, it wins on speed
        assert isinstance(choice.backend, _native.NativeReplay)
        assert choice.backend.name in exact_natives
    # Variants with other rounding are measured, not assumed: at least one is not exact.
    assert any(err > 0.0 for err in choice.candidates.values())
    [record] = [r for r in caplog.records if r.name == "gockpt.selfcheck"]
    assert record.levelno == logging.INFO
    assert choice.backend.name in record.getMessage() and choice.reason in record.getMessage()


def test_choice_is_logged_once_with_its_reason(caplog):
    caplog.set_level(logging.INFO, logger="gockpt.selfcheck")
    opt = _trained(RMSprop)
    for _ in range(3):
        choice = selfcheck.select_backend(opt)
    [record] = [r for r in caplog.records if r.name == "gockpt.selfcheck"]
    assert "RMSprop" in record.getMessage() and "uses torch" in record.getMessage()
    assert "only backend" in choice.reason


def test_live_optimizer_is_not_touched():
    opt = _trained(AdamW, amsgrad=True)
    before = [p.detach().clone() for p in opt.param_groups[0]["params"]]
    state_before = {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state.items()}
    group_before = {k: v for k, v in opt.param_groups[0].items() if k != "params"}
    selfcheck.select_backend(opt)
    for p, b in zip(opt.param_groups[0]["params"], before, strict=True):
        assert torch.equal(p, b) and p.grad is not None
    assert set(opt.state) == set(state_before)
    for k, s in opt.state.items():
        assert all(torch.equal(s[n], state_before[k][n]) for n in s)
    assert {k: v for k, v in opt.param_groups[0].items() if k != "params"} == group_before


def test_choice_is_cached_per_class_hparams_and_device(monkeypatch):
    opt = _trained(AdamW)
    first = selfcheck.select_backend(opt)

    def no_probe(*args, **kwargs):
        raise AssertionError("probed again")

    monkeypatch.setattr(selfcheck, "_probe", no_probe)
    assert selfcheck.select_backend(opt) is first
    opt.param_groups[0]["lr"] = 0.123  # lr changes every step under a scheduler: same key
    assert selfcheck.select_backend(opt) is first
    opt.param_groups[0]["weight_decay"] = 0.5  # a hyperparameter that matters: new probe
    with pytest.raises(AssertionError, match="probed again"):
        selfcheck.select_backend(opt)


def test_preferences_restrict_candidates():
    opt = _trained(SGD, lr=0.1, momentum=0.9)
    torch_only = selfcheck.select_backend(opt, "torch")
    assert isinstance(torch_only.backend, TorchReplay) and torch_only.exact
    assert list(torch_only.candidates) == ["torch"]
    native_only = selfcheck.select_backend(opt, "native")
    assert isinstance(native_only.backend, _native.NativeReplay) and native_only.exact
    assert "torch" not in native_only.candidates
    with pytest.raises(ValueError, match="preference"):
        selfcheck.select_backend(opt, "fastest")


def test_native_preference_for_unsupported_optimizer_raises():
    opt = _trained(RMSprop)
    with pytest.raises(ValueError, match="native kernel cannot replay RMSprop"):
        selfcheck.select_backend(opt, "native")
    choice = selfcheck.select_backend(opt)
    assert isinstance(choice.backend, TorchReplay) and choice.exact


def test_low_precision_parameters_are_left_to_torch():
    params = [torch.nn.Parameter(torch.randn(9).to(torch.bfloat16))]
    opt = AdamW(params)
    choice = selfcheck.select_backend(opt)
    assert list(choice.candidates) == ["torch"] and choice.exact


@pytest.mark.parametrize("cls", [AdamW, RMSprop, torch.optim.Adagrad])
def test_float16_probe_with_nan_elements_is_exact_where_the_bits_agree(monkeypatch, cls):
    """In float16 the default ``eps`` underflows: the live probe turns elements with zero
    gradients into NaN. Torch's replay gives the same bits (NaN payloads too), which is exact;
    a replay off by a little elsewhere is still told apart."""
    opt = cls([torch.nn.Parameter(torch.randn(9).to(torch.float16))])
    choice = selfcheck.select_backend(opt)
    assert choice.exact and choice.max_abs_error == 0.0
    selfcheck._cache.clear()
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [_Perturbed("off", 2.0**-10)])
    assert not selfcheck.select_backend(opt).exact


def test_closest_backend_is_chosen_when_none_is_exact(monkeypatch):
    far, near = _Perturbed("far", 1e-3), _Perturbed("near", 2.0**-20)
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [far, near])
    choice = selfcheck.select_backend(_trained(AdamW))
    assert choice.backend is near
    assert not choice.exact
    assert 0.0 < choice.max_abs_error == choice.candidates["near"] < choice.candidates["far"]
    assert "closest" in choice.reason


def test_fastest_exact_backend_wins(monkeypatch):
    slow, fast, wrong = _Perturbed("slow", 0.0), _Perturbed("fast", 0.0), _Perturbed("wrong", 1.0)
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [slow, wrong, fast])
    seconds = {"slow": 2.0, "fast": 1.0, "wrong": 0.0}
    monkeypatch.setattr(selfcheck, "_time_step", lambda b, *a: (seconds[b.name], 12_000_000))
    choice = selfcheck.select_backend(_trained(AdamW))
    assert choice.backend is fast and choice.exact
    assert "fastest of 2 exact candidates (slow 2.0x slower)" in choice.reason
    assert choice.replay_bytes_per_s == 12_000_000.0  # the chosen backend's pace
    assert choice.candidates == {"slow": 0.0, "wrong": choice.candidates["wrong"], "fast": 0.0}
    assert choice.candidates["wrong"] > 0.0


def test_missing_kernel_falls_back_to_torch_with_one_info_log(monkeypatch, caplog):
    monkeypatch.setattr(_native, "_ext", None)
    monkeypatch.setattr(_native, "_import_error", ImportError("no module named _gockpt_native"))
    monkeypatch.setattr(_native, "_reported_missing", False)
    caplog.set_level(logging.INFO, logger="gockpt._native")
    opt = _trained(AdamW)
    choice = selfcheck.select_backend(opt)
    assert isinstance(choice.backend, TorchReplay) and choice.exact
    assert list(choice.candidates) == ["torch"]
    selfcheck._cache.clear()
    selfcheck.select_backend(opt)
    assert _native.variants() == [] and not _native.available()
    records = [r for r in caplog.records if r.name == "gockpt._native"]
    assert len(records) == 1 and records[0].levelno == logging.INFO
    assert "torch backend" in records[0].getMessage()
    with pytest.raises(ValueError, match="not available"):
        selfcheck.select_backend(opt, "native")


class _Raising(_Perturbed):
    def step(self, *a):
        raise RuntimeError("this backend cannot replay here")


def test_a_candidate_that_raised_is_recorded_in_a_readable_manifest(monkeypatch, tmp_path):
    """A candidate that fails the probe has error inf; the manifest records it as "inf", since
    strict JSON (what the loader accepts) has no Infinity."""
    import json

    import gockpt

    ok, broken = _Perturbed("ok", 0.0), _Raising("broken", 0.0)
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [broken, ok])
    model = torch.nn.Linear(3, 2)
    opt = AdamW(model.parameters())
    eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="gockpt", max_overlap_steps=2))
    for i in range(4):
        model(torch.randn(4, 3)).sum().backward()
        opt.step()
        opt.zero_grad()
        if i == 1:
            handle = eng.save(str(tmp_path / "ckpt"))
    eng.close()
    handle.result()
    replay = json.loads((tmp_path / "ckpt" / "manifest.json").read_text())["meta"]["replay"]
    assert replay["candidates"] == {"broken": "inf", "ok": 0.0}
    gockpt.load_checkpoint(str(tmp_path / "ckpt"))  # strict JSON: loads


def test_the_chosen_backend_is_timed_even_alone_and_its_pace_is_state_bytes_per_second():
    # The pace seeds the planner's replay rate before the replay thread has timed an update:
    # one AdamW step over a tensor of about a million fp32 elements brings forward the
    # parameter and its two moments (12 bytes per element, the step count aside).
    selfcheck._cache.clear()
    choice = selfcheck.select_backend(_trained(AdamW), "torch")
    assert list(choice.candidates) == ["torch"] and choice.exact
    assert 1e6 < choice.replay_bytes_per_s < 1e13
    n = selfcheck._TIMING_NUMEL
    best, nbytes = selfcheck._time_step(choice.backend, AdamW, snapshot_hparams(
        _trained(AdamW).param_groups[0]), torch.float32, 1e-3)
    assert best > 0 and 12 * n <= nbytes <= 12 * n + 64


class _FailsOnLarge(_Perturbed):
    """Replays the probe's small tensors exactly; raises on a tensor of the timing step's size."""

    def step(self, optimizer_cls, hparams, params, grads, states):
        if any(p.numel() >= selfcheck._TIMING_NUMEL for p in params):
            raise RuntimeError("out of memory")
        super().step(optimizer_cls, hparams, params, grads, states)


def test_a_backend_whose_timing_step_raises_is_still_chosen_on_its_probe(monkeypatch):
    only = _FailsOnLarge("only", 0.0)
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [only])
    choice = selfcheck.select_backend(_trained(AdamW))
    assert choice.backend is only and choice.exact and choice.replay_bytes_per_s == 0.0


def test_a_failed_timing_ranks_its_backend_last_and_stays_out_of_the_reason(monkeypatch):
    broken, fine = _FailsOnLarge("broken", 0.0), _Perturbed("fine", 0.0)
    monkeypatch.setattr(selfcheck, "_candidates", lambda *a: [broken, fine])
    choice = selfcheck.select_backend(_trained(AdamW))
    assert choice.backend is fine and choice.replay_bytes_per_s > 0.0
    assert "inf" not in choice.reason and "nan" not in choice.reason
