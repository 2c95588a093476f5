"""The central invariant: every mode's checkpoint equals a blocking save of its captured step."""

from __future__ import annotations

import os
import threading
import time
import warnings

import pytest
import torch
from _loop import assert_state_equal, make, snapshot, train

import gockpt
import gockpt.writer
from gockpt import Engine, GoCkptConfig

MODES = ["sync", "async", "lazy", "gockpt", "gockpt_o", "auto"]


def _run(tmp_path, opt_name: str, mode: str, *, num_iters: int = 14, save_iters=(2, 3, 7),
         explicit: bool = False, unscale: bool = True, **cfg):
    """Train with checkpoints; return (engine metrics, {version: live snapshot}, paths)."""
    model, opt, sched, scaler = make(opt_name)
    # Room for two snapshots: the saves at iterations 2 and 3 overlap (K = 3) and each keeps its
    # own K. The default pool holds one snapshot (a later save finishes the first one early at
    # its step and shares it): tests/test_memory.py.
    cfg.setdefault("host_buffer_bytes", 1 << 20)
    config = GoCkptConfig(mode=mode, min_overlap_steps=cfg.pop("k", 3), max_overlap_steps=3,
                          max_shard_bytes=2048, **cfg)
    eng = Engine(model, opt, config, explicit_before_update=explicit)
    if explicit:
        # What a closure-running framework does: end each window right before the update.
        opt.register_step_pre_hook(lambda *a: None)
        original_step = opt.step

        def step(*a, **k):
            eng.before_update()
            return original_step(*a, **k)

        opt.step = step
    live: dict[int, dict] = {}
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if eng.version not in live:
            live[eng.version] = snapshot(model, opt)
            live[eng.version]["it"] = it
            live[eng.version]["sched"] = sched.state_dict()
        if it in save_iters:
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}"),
                                    state_fn=lambda it=it: {"sched": sched.state_dict(),
                                                            "rng": torch.get_rng_state()}))

    train(model, opt, sched, scaler, num_iters, on_step_end=on_step_end, unscale=unscale)
    eng.close()
    return [h.result() for h in handles], live, handles


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("opt_name", ["adamw", "adam_amsgrad_max", "sgd_nesterov"])
def test_replayed_state_equals_blocking_save(tmp_path, opt_name, mode):
    metrics, live, handles = _run(tmp_path, opt_name, mode)
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert v == m.captured_step
        if mode in ("gockpt", "gockpt_o"):
            assert m.num_overlap_steps == 3 and v == m.requested_step + 2
            assert m.grad_bytes > 0 and m.replay_backend
        elif mode in ("sync", "async", "lazy"):
            assert v == m.requested_step
        assert m.host_bytes >= m.state_bytes > 0  # the host memory it held (slot + gradients)
        assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")
        # Non-tensor state describes the same step as the tensors.
        assert_state_equal(state.extra["sched"], live[v]["sched"], f"{mode}:sched@{v}")


def test_skipped_step_is_not_replayed(tmp_path):
    # Saves around the GradScaler-skipped iteration 5: the window spans it without an update.
    metrics, live, _ = _run(tmp_path, "adamw", "gockpt", save_iters=(4, 5), num_iters=12)
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])


@pytest.mark.parametrize("unscale", [True, False], ids=["unscaled", "kernel-unscales"])
@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("opt_name", ["adamw_fused", "sgd_fused", "adagrad_fused"])
def test_a_fused_optimizer_stepped_on_a_skipped_iteration_is_not_replayed(
        tmp_path, opt_name, mode, unscale):
    # GradScaler calls step() of an optimizer that scales for it (fused kernels) on a skipped
    # iteration too: the update fires the step hooks but changes nothing, and the replay must
    # change nothing either. Without unscale_ the kernel unscales the gradients (Lightning's
    # path for such optimizers): the replay reads them as the kernel left them.
    metrics, live, _ = _run(tmp_path, opt_name, mode, save_iters=(3, 4), num_iters=11,
                            unscale=unscale)
    # The skipped iteration fired the step hooks: the engine counted it as an update.
    assert all(v == live[v]["it"] + 1 for v in live)
    for m in metrics:
        assert m.mode == mode and m.num_overlap_steps == 3
        assert m.requested_step <= 5 <= m.captured_step  # the windows span the skipped update
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert_state_equal(state.model_state_dict, live[v]["model"], f"model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"optim@{v}")


def test_explicit_window_end_is_exact(tmp_path):
    metrics, live, _ = _run(tmp_path, "adamw", "gockpt_o", explicit=True)
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[state.captured_step]["model"])
        assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])


@pytest.mark.parametrize("opt_name", ["rmsprop", "adagrad"])
def test_other_torch_optimizers_replay_exactly(tmp_path, opt_name):
    metrics, live, _ = _run(tmp_path, opt_name, "gockpt")
    for m in metrics:
        assert m.mode == "gockpt" and m.num_overlap_steps == 3
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])


def test_unreplayable_optimizer_falls_back_to_lazy_with_one_warning(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.LBFGS(model.parameters(), lr=0.1)
    x = torch.randn(8, 4)

    def closure():
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        return loss

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        eng = Engine(model, opt, GoCkptConfig(mode="gockpt"))
        opt.step(closure)
        h1 = eng.save(str(tmp_path / "a"))
        opt.step(closure)
        h2 = eng.save(str(tmp_path / "b"))
        opt.step(closure)
        eng.close()
    assert [m.mode for m in (h1.result(), h2.result())] == ["lazy", "lazy"]
    assert sum("cannot replay LBFGS" in str(x.message) for x in w) == 1


def test_flush_finishes_pending_checkpoint_at_current_step(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    h = eng.save(str(tmp_path / "c"))
    train(model, opt, sched, scaler, 4, start_iter=3)  # one more update: window 1 of 3
    want = snapshot(model, opt)
    eng.wait()
    m = h.result()
    assert m.captured_step == m.requested_step + 1 == eng.version
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"])
    assert_state_equal(state.model_state_dict, want["model"])
    eng.close()


def test_training_proceeds_while_copy_and_persist_run(tmp_path, monkeypatch):
    """Overlap without sleeps: persist is held at a barrier while the training thread steps."""
    from faultfs import Fault, FaultLocalFileSystem, local_url

    gate = threading.Event()
    entered = threading.Event()

    def held(name, nbytes):  # the storage holds the first write until the gate opens
        entered.set()
        assert gate.wait(30)

    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault(hook=held))
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="async"))
    train(model, opt, sched, scaler, 2)
    h = eng.save(local_url(tmp_path / "d"))
    assert entered.wait(30)
    v0 = eng.version
    train(model, opt, sched, scaler, 6, start_iter=2)  # the training thread is not blocked
    assert eng.version > v0 and not h.done()
    gate.set()
    assert h.result(30).captured_step == v0
    eng.close()


def test_background_error_is_raised_on_training_thread(tmp_path, monkeypatch):
    from faultfs import Fault, FaultLocalFileSystem, local_url

    def broken(name, nbytes):  # a full disk
        raise OSError(28, "No space left on device", name)

    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="async"))
    train(model, opt, sched, scaler, 2)
    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault(hook=broken))
    h = eng.save(local_url(tmp_path / "e"))
    deadline = time.monotonic() + 30
    while not h.done():  # done() only: the error is not read
        assert time.monotonic() < deadline
        time.sleep(0.01)
    with pytest.raises(OSError, match="No space left") as raised:  # its own type, not a wrapper
        eng.save(local_url(tmp_path / "f"))  # the next request raises it
    assert raised.value.errno == 28
    h = eng.save(local_url(tmp_path / "g"))
    with pytest.raises(OSError, match="No space left"):
        h.result(30)  # read by its handle on the training thread ...
    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault())  # room again
    eng.step_end()  # ... so not raised again
    eng.save(local_url(tmp_path / "h"))
    eng.close()  # nothing left to raise
    assert gockpt.is_complete(str(tmp_path / "h"))


def test_remove_cancels_in_flight_save(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    path = str(tmp_path / "g")
    h = eng.save(path)
    train(model, opt, sched, scaler, 4, start_iter=3)
    eng.remove(path)
    with pytest.raises(gockpt.CheckpointCancelledError):
        h.result(30)
    eng.close()
    assert not (tmp_path / "g").exists()
    assert [p.name for p in tmp_path.iterdir() if "gockpt-tmp" in p.name] == []


def test_restore_into_live_model(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    train(model, opt, sched, scaler, 3)
    h = eng.save(str(tmp_path / "r"), state_fn=lambda: {"note": "x"})
    train(model, opt, sched, scaler, 5, start_iter=3)
    eng.close()
    m = h.result()
    model2, opt2, _, _ = make("adamw", seed=1)
    eng2 = Engine(model2, opt2, GoCkptConfig(mode="sync"))
    assert eng2.restore(m.path) == {"note": "x"}
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(model2.state_dict(), state.model_state_dict)
    eng2.close()


def test_restore_rejects_model_that_does_not_fit(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="sync"))
    train(model, opt, sched, scaler, 2)
    m = eng.save(str(tmp_path / "s")).result()
    eng.close()
    other = torch.nn.Sequential(torch.nn.Linear(8, 3))
    with pytest.raises(ValueError, match="not in the model|lacks model keys"):
        gockpt.load_into(other, [torch.optim.AdamW(other.parameters())], gockpt.load_checkpoint(m.path))


@pytest.mark.parametrize("mode", ["gockpt_o", "async"])
def test_engine_on_memory_filesystem(mode):
    import uuid

    root = f"memory://engine-{uuid.uuid4().hex}"
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2, max_overlap_steps=2,
                                          max_shard_bytes=1024))
    live = {}
    requested = []

    def on_step_end(it):
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it in (2, 3):
            requested.append(eng.version)
            eng.save(f"{root}/ckpt")  # re-saves the same path while the first is in flight

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    state = gockpt.load_checkpoint(f"{root}/ckpt")
    assert state.manifest["meta"]["requested_step"] == requested[-1]  # the newer save won
    assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])
    assert gockpt.latest_checkpoint(root) == f"{root}/ckpt"


def test_full_pool_skips_by_policy_and_waits_by_default(tmp_path, caplog):
    model, opt, sched, scaler = make("adamw")
    cfg = dict(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3, max_inflight=1)
    eng = Engine(model, opt, GoCkptConfig(when_full="skip", **cfg))
    train(model, opt, sched, scaler, 2)
    first = eng.save(str(tmp_path / "a"))
    train(model, opt, sched, scaler, 3, start_iter=2)  # a later step: no sharing
    with caplog.at_level("INFO", logger="gockpt"):
        second = eng.save(str(tmp_path / "b"))  # the only slot is still in its copy windows
        third = eng.save(str(tmp_path / "b2"))
    assert second.done() and second.skipped and third.skipped and not first.skipped
    # A loop that reads no handle still learns of it: the first skip is a warning.
    skips = [r for r in caplog.records if "skipped checkpoint" in r.getMessage()]
    assert [r.levelname for r in skips] == ["WARNING", "INFO"], skips
    eng.close()
    assert first.result().captured_step is not None and not (tmp_path / "b").exists()

    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(**cfg))
    train(model, opt, sched, scaler, 2)
    first = eng.save(str(tmp_path / "c"))
    train(model, opt, sched, scaler, 3, start_iter=2)
    second = eng.save(str(tmp_path / "d"))  # waits: the first finishes early at this step
    assert first.result().captured_step == first.requested_step + 1
    eng.close()
    # ... and the second shares its snapshot, taken at the second's own step.
    m = second.result()
    assert not second.skipped and m.captured_step == m.requested_step and m.host_shared


def test_reloaded_optimizer_state_is_tracked(tmp_path):
    """optimizer.load_state_dict replaces the state tensors: later saves must copy the new ones."""
    import copy

    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    train(model, opt, sched, scaler, 3)
    eng.save(str(tmp_path / "a")).result()
    opt.load_state_dict(copy.deepcopy(opt.state_dict()))  # new tensors, same values
    live = {}

    def on_step_end(it):
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 5, start_iter=3, on_step_end=on_step_end)
    m = eng.save(str(tmp_path / "b")).result()
    eng.close()
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])


def test_several_optimizers_copy_in_one_step(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = [torch.optim.AdamW(model[0].parameters()), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    eng = Engine(model, opts, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    x = torch.randn(8, 4)
    handle = None
    for it in range(5):
        model(x).pow(2).mean().backward()
        for o in opts:
            o.step()
            o.zero_grad()
        if it == 1:
            want = {"model": copy_sd(model), "optims": [copy_sd(o) for o in opts]}
            handle = eng.save(str(tmp_path / "m"))
    eng.close()
    m = handle.result()
    assert m.num_overlap_steps == 1 and m.captured_step == m.requested_step
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.model_state_dict, want["model"])
    for got, exp in zip(state.optimizer_state_dicts, want["optims"], strict=True):
        assert_state_equal(got, exp)


def test_a_parameter_in_two_optimizers_is_refused_at_the_start_naming_it(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opts = [torch.optim.AdamW(model.parameters()), torch.optim.SGD([model[1].weight], lr=0.1)]
    with pytest.raises(ValueError, match=r"two optimizers.*optimizer 1, parameter 0, shape \(2, 4\)"):
        Engine(model, opts)
    # Shared later (add_param_group): the next save fails with the same words, nothing written.
    opts = [torch.optim.AdamW(model[0].parameters()), torch.optim.SGD(model[1].parameters(), lr=0.1)]
    eng = Engine(model, opts, GoCkptConfig(mode="lazy"))
    model(torch.randn(8, 4)).pow(2).mean().backward()
    for o in opts:
        o.step()
    opts[0].add_param_group({"params": [model[1].bias]})
    with pytest.raises(ValueError, match=r"two optimizers.*optimizer 1, parameter 1, shape \(2,\)"):
        eng.save(str(tmp_path / "m"))
    eng.close()
    assert not (tmp_path / "m").exists()


def copy_sd(obj):
    import copy

    return copy.deepcopy(obj.state_dict())


def test_resumed_engine_counts_from_the_checkpoint_and_moves_latest(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="sync"))
    train(model, opt, sched, scaler, 6)  # one of them is GradScaler-skipped
    v = eng.version
    eng.save(str(tmp_path / "run1"))
    eng.close()
    model, opt, sched, scaler = make("adamw", seed=3)
    eng = Engine(model, opt, GoCkptConfig(mode="sync"))
    eng.restore(str(tmp_path / "run1"))
    assert eng.version == v == 5
    # A fresh engine over already-trained optimizers reads the step from their state.
    other = Engine(model, opt, GoCkptConfig(mode="sync"))
    assert other.version == v
    other.close()
    train(model, opt, sched, scaler, 3)
    m = eng.save(str(tmp_path / "run2")).result()
    eng.close()
    assert m.captured_step == v + 3 and gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "run2")


class _Rebinding(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)
        self.register_buffer("count", torch.zeros(()))

    def forward(self, x):
        self.count = self.count + 1  # a new tensor every forward
        return self.lin(x)


@pytest.mark.parametrize("mode", ["lazy", "gockpt"])
def test_rebound_buffer_is_taken_at_the_captured_step(tmp_path, mode):
    torch.manual_seed(0)
    model = _Rebinding()
    opt = torch.optim.AdamW(model.parameters())
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2, max_overlap_steps=2))
    live, handle = {}, None
    for it in range(6):
        model(torch.randn(2, 4)).sum().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        live.setdefault(eng.version, copy_sd(model))
        if it == 2:
            handle = eng.save(str(tmp_path / "b"))
    eng.close()
    state = gockpt.load_checkpoint(handle.result().path)
    assert_state_equal(state.model_state_dict, live[state.captured_step])


def test_state_appearing_after_the_request_is_not_lost(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    opt = torch.optim.Adam(model.parameters())
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    live, handle = {}, None
    for it in range(6):
        out = model[0](torch.randn(2, 4)) if it < 2 else model(torch.randn(2, 4))
        out.sum().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        live.setdefault(eng.version, {"m": copy_sd(model), "o": copy_sd(opt)})
        if it == 1:  # model[1] has no optimizer state yet: it gets some in the next step
            handle = eng.save(str(tmp_path / "s"))
    eng.close()
    m = handle.result()
    assert m.mode == "lazy"
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["o"])


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_in_place_zero_grad_is_safe(tmp_path, mode):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    live, handles = {}, []
    x = torch.randn(16, 8)
    for it in range(8):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it in (1, 2):
            handles.append(eng.save(str(tmp_path / f"z{it}")))
    eng.close()
    for h in handles:
        state = gockpt.load_checkpoint(h.result().path)
        assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])


def test_gockpt_o_guards_drop_at_set_to_none_and_stay_where_gradients_accumulate(tmp_path):
    # gockpt_o copies each step's gradients while the next step runs; a tensor hook guards a
    # gradient that the next backward would accumulate into. zero_grad(set_to_none=True) makes
    # that impossible for the gradients it clears, so their guards go; a step without
    # zero_grad keeps them (the copies are slowed by an emulated link, so the next backward may
    # meet one in flight). Either way each checkpoint equals the live state.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3,
                                          max_overlap_steps=3, host_link_bytes_per_s=1e7))
    windows = eng._windows  # noqa: SLF001 - the guards are not public
    live, handles, guarded_after_clear = {}, [], []
    x = torch.randn(16, 8)
    for it in range(12):
        model(x).pow(2).mean().backward()
        opt.step()
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it % 3 != 2:  # every third step accumulates into the last gradients
            opt.zero_grad(set_to_none=True)
            guarded_after_clear.append(len(windows._guard_handles))  # noqa: SLF001
        if it in (1, 5):
            handles.append(eng.save(str(tmp_path / f"g{it}")))
    eng.close()
    assert guarded_after_clear and not any(guarded_after_clear)
    for h in handles:
        m = h.result()
        assert m.mode == "gockpt_o" and m.num_overlap_steps == 3
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.optimizer_state_dicts[0], live[state.captured_step]["optim"])
        assert_state_equal(state.model_state_dict, live[state.captured_step]["model"])


@pytest.mark.parametrize("mode", ["sync", "lazy", "gockpt"])
def test_failing_state_fn_fails_only_that_save(tmp_path, mode):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2, max_overlap_steps=2,
                                          max_inflight=1))
    train(model, opt, sched, scaler, 2)

    def boom():
        raise KeyError("state_fn broke")

    bad = None
    with pytest.raises((KeyError, RuntimeError)):  # at the request (sync) or at the next hook
        bad = eng.save(str(tmp_path / "bad"), state_fn=boom)
        train(model, opt, sched, scaler, 4, start_iter=2)
        eng.wait()
    if bad is not None:
        with pytest.raises(KeyError):
            bad.result(30)
    opt.zero_grad()
    scaler = torch.amp.GradScaler("cpu")  # the error interrupted the scaler's step sequence
    good = eng.save(str(tmp_path / "good"))  # the slot came back
    train(model, opt, sched, scaler, 7, start_iter=4)
    eng.close()
    assert good.result().captured_step is not None and not (tmp_path / "bad").exists()


def test_optimizer_parameter_outside_the_model_round_trips(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    temperature = torch.nn.Parameter(torch.ones(()))
    opt = torch.optim.AdamW([*model.parameters(), temperature])
    eng = Engine(model, opt, GoCkptConfig(mode="sync"))
    (model(torch.randn(3, 4)).sum() * temperature).backward()
    opt.step()
    eng.save(str(tmp_path / "t"))
    eng.close()
    want = temperature.detach().clone()
    with torch.no_grad():
        temperature.fill_(5.0)
    gockpt.load_into(model, [opt], gockpt.load_checkpoint(str(tmp_path / "t")))
    assert torch.equal(temperature.detach(), want)


@pytest.mark.parametrize("mode", ["lazy", "gockpt", "gockpt_o"])
def test_weights_swapped_around_a_request_are_saved_as_a_blocking_save_would(tmp_path, mode):
    # A callback swaps other weights in, saves, and swaps the live ones back (what Lightning's
    # ModelCheckpoint does for manual optimization, and EMA/SWA evaluations): the checkpoint
    # holds the swapped-in weights, and training is not disturbed.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    live = copy_sd(model)
    other = {k: v + 1 if v.is_floating_point() else v for k, v in live.items()}
    model.load_state_dict(other)
    want = snapshot(model, opt)
    h = eng.save(str(tmp_path / "swapped"))
    model.load_state_dict(live)
    train(model, opt, sched, scaler, 8, start_iter=3)
    eng.wait()
    m = h.result()
    assert m.mode == "async" and m.captured_step == m.requested_step
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.model_state_dict, want["model"])
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"])
    # A later request, with no edit in between, takes the configured path again.
    assert eng.save(str(tmp_path / "later")).metrics.mode == mode
    eng.close()


@pytest.mark.parametrize("mode", ["lazy", "gockpt"])
def test_an_edit_after_the_request_is_taken_live_or_fails_that_save_only(tmp_path, mode, caplog):
    # An in-place edit right after the request, while the first block is being copied. In a
    # multi-step save the step is taken later: the edited tensors are copied at the capture and
    # the checkpoint equals the live state there bit for bit. In lazy mode the step was taken
    # at the request, so the copy in flight may hold the edit: that save alone fails, no
    # exception reaches the loop, and the one before stands.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    eng.save(str(tmp_path / "before")).result()
    h = eng.save(str(tmp_path / "edited"))
    with torch.no_grad():
        for p in model.parameters():  # in place, outside optimizer.step(), before any copy ends
            p.add_(1.0)
    live = {}
    train(model, opt, sched, scaler, 8, start_iter=3,
          on_step_end=lambda it: live.setdefault(eng.version, snapshot(model, opt)))
    with caplog.at_level("WARNING", logger="gockpt"):
        eng.wait()
    if mode == "lazy":
        with pytest.raises(gockpt.CheckpointTornError, match="outside optimizer.step"):
            h.result()
        assert any("edited" in r.getMessage() for r in caplog.records)
        assert not (tmp_path / "edited").exists()
    else:
        m = h.result()
        assert m.captured_step == m.requested_step + 2
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[m.captured_step]["model"])
        assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])
    assert gockpt.is_complete(str(tmp_path / "before"))
    after = eng.save(str(tmp_path / "after"))  # the engine goes on
    eng.wait()
    # It has seen an edit between two updates: later saves are copied at their request.
    assert after.result().mode == "async" and gockpt.is_complete(str(tmp_path / "after"))
    eng.close()


EXIT_WITHOUT_CLOSE = """
import sys, torch, gockpt
model = torch.nn.Linear(64, 64)
opt = torch.optim.AdamW(model.parameters(), lr=0.1)
eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=sys.argv[2]))
for _ in range(3):
    model(torch.randn(4, 64)).sum().backward(); opt.step(); opt.zero_grad()
eng.save(sys.argv[1] + "/ckpt")
torch.save(model.state_dict(), sys.argv[1] + "/want.pt")
if sys.argv[3] == "raise":
    raise RuntimeError("the script dies here")
"""


@pytest.mark.parametrize("mode", ["lazy", "async"])
@pytest.mark.parametrize("how", ["return", "raise"])
def test_a_save_requested_just_before_the_process_exits_is_finished(tmp_path, mode, how):
    """A script whose last call is a save (or that dies right after one) still gets it."""
    import subprocess
    import sys
    from pathlib import Path

    env = {"PYTHONPATH": str(Path(__file__).resolve().parent.parent), "PATH": "/usr/bin:/bin"}
    proc = subprocess.run([sys.executable, "-c", EXIT_WITHOUT_CLOSE, str(tmp_path), mode, how],
                          capture_output=True, text=True, env=env, timeout=120)
    assert (proc.returncode != 0) == (how == "raise"), proc.stderr
    assert gockpt.is_complete(str(tmp_path / "ckpt")), proc.stderr
    state = gockpt.load_checkpoint(str(tmp_path / "ckpt"))
    assert_state_equal(state.model_state_dict, torch.load(tmp_path / "want.pt"))
    assert not [n for n in (tmp_path).iterdir() if ".gockpt-" in n.name]


@pytest.mark.parametrize("mode", ["lazy", "gockpt", "gockpt_o"])
@pytest.mark.parametrize("what", ["model", "submodule", "optimizer"])
def test_load_state_dict_after_a_request_finishes_its_copies_first(tmp_path, mode, what):
    # Accelerate's save_state -> model.load_state_dict(...) -> load_state pattern, with no step
    # in between: the checkpoint holds the state at the request, and nothing fails.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    want = snapshot(model, opt)
    h = eng.save(str(tmp_path / "c"))
    other_model, other_opt = make("adamw", seed=1)[:2]
    if what == "model":
        model.load_state_dict(other_model.state_dict())
    elif what == "submodule":
        model.out.load_state_dict(other_model.out.state_dict())
    else:
        opt.load_state_dict(copy_sd(opt) | {"state": {}})
    train(model, opt, sched, scaler, 6, start_iter=3)
    eng.wait()
    m = h.result()
    assert m.captured_step == m.requested_step
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.model_state_dict, want["model"])
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"])
    eng.close()


def test_the_tracked_model_can_be_deep_copied_and_pickled_mid_save(tmp_path):
    # EMA/SWA callbacks and user code deep-copy the model; some pickle it whole. Neither may
    # drag the engine (threads, locks) along, and the copy must not drive the engine.
    import copy
    import io

    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    want = snapshot(model, opt)
    h = eng.save(str(tmp_path / "c"))
    twin = copy.deepcopy(model)
    opt_twin = copy.deepcopy(opt)
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for m in (twin, loaded):
        m.load_state_dict(m.state_dict())  # the copy's hooks are inert
        m(torch.randn(16, 8))
    opt_twin.load_state_dict(opt_twin.state_dict())
    assert not h.done() and eng.version == 3  # nothing above moved the engine
    eng.flush()
    eng.wait()
    state = gockpt.load_checkpoint(h.result().path)
    assert_state_equal(state.model_state_dict, want["model"])
    eng.close()


class _OwnLayout(gockpt.writer.CheckpointWriter):
    """A writer with a layout of its own: the weights under their state_dict names in one
    safetensors file, the optimizer state torch.save'd, hooks recorded."""

    def __init__(self, staging=None):
        self.staging = staging
        self.calls = []

    def tensor_files(self, layout):
        names = {e.key: e.key.removeprefix("model.") for e in layout.entries if e.key.startswith("model.")}
        return [gockpt.writer.TensorFile("model.safetensors", sorted(names.items()), {"format": "pt"})]

    def files(self, snap):
        import io

        buf = io.BytesIO()
        torch.save(copy_tree(snap.optimizer_state_dicts[0]), buf)
        return {"optimizer.bin": buf.getvalue()}

    def before_publish(self, snap):
        self.calls.append(("before", sorted(os.listdir(snap.staging)) if snap.staging else None))

    def after_publish(self, snap):
        self.calls.append(("after", snap.metrics.captured_step))


def copy_tree(tree):
    import copy

    return copy.deepcopy(tree)  # the snapshot's tensors are views of a reused host buffer


@pytest.mark.parametrize("mode", ["lazy", "gockpt", "gockpt_o"])
def test_a_writer_lays_out_the_files_and_they_equal_a_blocking_save(tmp_path, mode):
    from safetensors.torch import load_file

    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    live = {eng.version: snapshot(model, opt)}
    staging = tmp_path / f".ckpt.gockpt-tmp-{os.getpid()}-ab12"
    staging.mkdir()
    (staging / "from_another_rank.pkl").write_bytes(b"x")  # a file another process added
    writer = _OwnLayout(str(staging))
    h = eng.save(str(tmp_path / "ckpt"), writer=writer)
    train(model, opt, sched, scaler, 8, start_iter=3,
          on_step_end=lambda it: live.setdefault(eng.version, snapshot(model, opt)))
    eng.wait()
    m = h.result()
    want = live[m.captured_step]
    files = sorted(os.listdir(tmp_path / "ckpt"))
    assert "model.safetensors" in files and "optimizer.bin" in files and "from_another_rank.pkl" in files
    assert not [f for f in files if f.startswith("shard-")]  # written once, in the writer's layout
    weights = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    for k, v in want["model"].items():
        if v.is_floating_point():
            assert torch.equal(weights[k], v), k
    assert_state_equal(torch.load(tmp_path / "ckpt" / "optimizer.bin"), want["optim"])
    assert writer.calls[0][0] == "before" and "model.safetensors" in writer.calls[0][1]
    assert writer.calls[1] == ("after", m.captured_step)
    assert gockpt.is_complete(str(tmp_path / "ckpt"))
    eng.close()


class _WeightsOnly(gockpt.writer.CheckpointWriter):
    """Stores the model's tensors under their layout keys and nothing of the optimizer."""

    def tensor_files(self, layout):
        keys = [e.key for e in layout.entries if e.key.startswith("model.")]
        return [gockpt.writer.TensorFile("weights.safetensors", [(k, k) for k in keys])]


@pytest.mark.parametrize("mode", ["lazy", "gockpt_o"])
def test_a_writer_that_stores_no_optimizer_state_leaves_a_loadable_checkpoint(tmp_path, mode):
    """The optimizer state is still copied (and replayed) but not written: the checkpoint's
    record names no tensor it does not hold, so it loads, with no optimizer state."""
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    train(model, opt, sched, scaler, 3)
    live = {eng.version: snapshot(model, opt)}
    h = eng.save(str(tmp_path / "ckpt"), writer=_WeightsOnly())
    train(model, opt, sched, scaler, 8, start_iter=3,
          on_step_end=lambda it: live.setdefault(eng.version, snapshot(model, opt)))
    eng.close()
    m = h.result()
    state = gockpt.load_checkpoint(str(tmp_path / "ckpt"))
    assert state.optimizer_state_dicts == []
    assert not [k for k in state.manifest["tensors"] if not k.startswith("model.")]
    for k, v in live[m.captured_step]["model"].items():
        assert torch.equal(state.model_state_dict[k], v), k


def test_remove_unpublishes_at_once_and_deletes_the_files_before_close_returns(tmp_path):
    """Engine.remove: the checkpoint is gone from its path when the call returns (renamed aside,
    the parent fsynced); its files are deleted (on a thread when large), all of them by the time
    close() returns, leaving nothing behind."""
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="async"))
    train(model, opt, sched, scaler, 2)
    eng.save(str(tmp_path / "a")).result()
    eng.save(str(tmp_path / "b")).result()
    eng.remove(str(tmp_path / "a"))
    assert not (tmp_path / "a").exists() and gockpt.is_complete(str(tmp_path / "b"))
    eng.close()
    assert sorted(os.listdir(tmp_path)) == ["b", "latest"]  # no scratch entry left


def test_remove_checkpoint_hands_the_renamed_tree_to_discard(tmp_path):
    """remove_checkpoint(discard=...): the checkpoint is gone from its path before the callable
    gets the renamed tree, whole, to delete (as Engine.remove does on a thread)."""
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="async"))
    train(model, opt, sched, scaler, 1)
    eng.save(str(tmp_path / "a")).result()
    eng.close()
    files = sorted(os.listdir(tmp_path / "a"))
    seen = []

    def discard(aside):
        assert not (tmp_path / "a").exists()
        seen.append((os.path.basename(aside), sorted(os.listdir(aside))))
        gockpt.fsutil.remove_local(aside)

    gockpt.remove_checkpoint(str(tmp_path / "a"), discard=discard)
    assert len(seen) == 1 and seen[0][0].startswith(".a.gockpt-tmp-") and seen[0][1] == files
    assert sorted(os.listdir(tmp_path)) == ["latest"] or sorted(os.listdir(tmp_path)) == []


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("change", ["appears", "replaced"])
def test_optimizer_state_that_changes_during_the_windows_is_taken_live(tmp_path, mode, change):
    """Optimizer state that is not among the tensors the layout tracked when the save was
    requested, because it appeared (a parameter unfrozen during the windows) or was replaced
    by a new tensor (not updated in place), is copied live at the capture, with its parameter.
    The checkpoint equals the live state at its captured step."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 8), torch.nn.Linear(8, 2))
    if change == "appears":
        for p in model[1].parameters():
            p.requires_grad_(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    x = torch.randn(16, 8)
    live = {}

    def step():
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))

    for _ in range(3):
        step()
    eng.save(str(tmp_path / "warm")).result()  # the layout is built before the change
    for _ in range(2):
        step()
    handle = eng.save(str(tmp_path / "a"))
    step()
    changed_at = eng.version
    if change == "appears":
        for p in model[1].parameters():
            p.requires_grad_(True)
    else:  # the block of model[0] was copied in the first window: its host copy is stale now
        st = opt.state[model[0].weight]
        st["exp_avg"] = st["exp_avg"] * 2 + 1
    for _ in range(4):
        step()
    eng.close()
    m = handle.result()
    state = gockpt.load_checkpoint(m.path)
    v = state.captured_step
    assert v > changed_at and m.num_overlap_steps == 3
    assert set(state.optimizer_state_dicts[0]["state"]) == set(live[v]["optim"]["state"])
    assert_state_equal(state.model_state_dict, live[v]["model"])
    assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"])


def test_a_newer_save_of_the_same_directory_spelled_otherwise_is_not_overwritten(tmp_path):
    # An older multi-step save of d/ckpt is still in its copy windows when a newer blocking
    # save of the same directory, spelled through a symlinked parent, publishes. The older one
    # must be dropped as superseded, not published over the newer checkpoint.
    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "alias")
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                          max_inflight=2, host_buffer_bytes=1 << 20))
    handles = {}

    def on_step_end(it):
        eng.step_end()
        if it == 2:
            handles["older"] = eng.save(str(tmp_path / "d" / "ckpt"))
        if it == 3:
            handles["newer"] = eng.save(str(tmp_path / "alias" / "." / "ckpt"), mode="sync")
            handles["newer"].result()  # published while the older one is still copying
            handles["live"] = snapshot(model, opt)

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    older, newer = handles["older"].result(), handles["newer"].result()
    assert newer.num_overlap_steps == 1 and older.num_overlap_steps == 3
    assert older.superseded and not newer.superseded
    state = gockpt.load_checkpoint(str(tmp_path / "d" / "ckpt"))
    assert state.captured_step == newer.captured_step > older.requested_step
    assert_state_equal(state.optimizer_state_dicts[0], handles["live"]["optim"])


def test_remove_cancels_a_save_in_flight_of_the_same_directory_spelled_otherwise(tmp_path):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    handles = []

    def on_step_end(it):
        eng.step_end()
        if it == 2:
            handles.append(eng.save(str(tmp_path / "ckpt")))
        if it == 3:  # still in its copy windows
            assert not handles[0].done()
            eng.remove(str(tmp_path / "." / "ckpt") + "/")

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    assert handles[0].done() and not (tmp_path / "ckpt").exists()
    assert gockpt.latest_checkpoint(str(tmp_path)) is None


def test_a_save_lands_where_its_path_named_at_the_request(tmp_path, monkeypatch):
    # The persist runs after the request; a chdir, and a parent symlink re-pointed, in between
    # must not move the checkpoint, nor let it publish over the other directory's checkpoint.
    for d in ("run1", "run2", "a", "b"):
        (tmp_path / d).mkdir()
    os.symlink(tmp_path / "a", tmp_path / "cur")
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                          max_inflight=2, host_buffer_bytes=1 << 20))
    handles, live = {}, {}
    monkeypatch.chdir(tmp_path / "run1")

    def on_step_end(it):
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))  # what a blocking save would hold
        if it == 2:
            handles["rel"] = eng.save("ckpt")
            handles["link"] = eng.save(str(tmp_path / "cur" / "ckpt"))
        if it == 3:  # both still in their copy windows
            assert not handles["rel"].done() and not handles["link"].done()
            os.chdir(tmp_path / "run2")
            os.unlink(tmp_path / "cur")
            os.symlink(tmp_path / "b", tmp_path / "cur")

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    rel, link = handles["rel"].result(), handles["link"].result()
    assert not (tmp_path / "run2" / "ckpt").exists() and not (tmp_path / "b" / "ckpt").exists()
    assert rel.path == str(tmp_path.resolve() / "run1" / "ckpt")
    assert link.path == str(tmp_path.resolve() / "a" / "ckpt")
    assert not rel.superseded and not link.superseded
    for where, m in ((tmp_path / "run1" / "ckpt", rel), (tmp_path / "a" / "ckpt", link)):
        state = gockpt.load_checkpoint(str(where))
        assert state.captured_step == m.captured_step
        assert_state_equal(state.model_state_dict, live[m.captured_step]["model"])
        assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])


def test_a_loop_that_edits_weights_between_updates_gets_every_checkpoint_exact(tmp_path):
    # A max-norm style clamp right after each step boundary, where a save was just requested:
    # once the engine has seen such an edit between two updates it copies later saves at their
    # request, so none is failed by an edit inside its windows, and each holds the state at its
    # request bit for bit.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3))
    handles, live = [], {}

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 6, 9):
            live[eng.version] = snapshot(model, opt)
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        with torch.no_grad():
            for p in model.parameters():
                p.clamp_(-0.2, 0.2)

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    for h in handles:
        m = h.result()
        assert m.mode == "async" and m.captured_step == m.requested_step
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[m.captured_step]["model"])
        assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])


def test_a_load_state_dict_between_updates_is_not_taken_for_a_weight_edit(tmp_path):
    # load_state_dict writes the live tensors in place too; it finishes pending copies by itself,
    # so it does not make later saves copy at their request.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3))
    with torch.no_grad():  # an in-place init after the engine, before any update: not the loop's
        for p in model.parameters():
            p.mul_(1.0)
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 3:
            model.load_state_dict(model.state_dict())
            opt.load_state_dict(opt.state_dict())
        if it in (5, 9):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 13, on_step_end=on_step_end)
    eng.close()
    assert [(h.result().mode, h.result().num_overlap_steps) for h in handles] == [("gockpt_o", 3)] * 2


def _contiguous(sd: dict) -> dict:
    return {k: v.clone(memory_format=torch.contiguous_format) for k, v in sd.items()}


def _assert_one_save_holds_live(tmp_path, model, opt, step, *, k: int, save_at: int,
                                **config) -> None:
    """Train 8 steps (``step()``: forward, backward, update), save after step ``save_at`` in
    mode gockpt with K = ``k``: the checkpoint holds the live weights of its captured step bit
    for bit (compared contiguous: channels_last weights)."""
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=k, max_overlap_steps=k,
                                          **config))
    live, handles = {}, []
    for it in range(8):
        step()
        eng.step_end()
        live.setdefault(eng.version, _contiguous(model.state_dict()))
        if it == save_at:
            handles.append(eng.save(str(tmp_path / "ckpt")))
    eng.close()
    m = handles[0].result()
    assert m.mode == "gockpt" and m.captured_step == m.requested_step + k - 1
    assert_state_equal(_contiguous(gockpt.load_checkpoint(m.path).model_state_dict),
                       live[m.captured_step])


@pytest.mark.parametrize("other", [torch.float16, torch.bfloat16, torch.float32])
def test_replay_of_a_channels_last_half_precision_weight_is_exact(tmp_path, other):
    # ATen steps a channels_last bf16 tensor with other loops than its contiguous copy, and
    # rounds differently: the replay steps the host copy in the live tensor's memory order.
    torch.manual_seed(0)
    conv = torch.nn.Conv2d(3, 8, 3).to(torch.bfloat16).to(memory_format=torch.channels_last)
    lin = torch.nn.Linear(8, 8).to(other)
    head = torch.nn.Linear(8, 4)
    model = torch.nn.ModuleDict({"conv": conv, "lin": lin, "head": head})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    data = iter(torch.randn(16, 2, 3, 6, 6, generator=torch.Generator().manual_seed(1)))

    def step() -> None:
        h = lin(conv(next(data).to(torch.bfloat16)).mean((2, 3)).to(other))
        head(h.float()).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    _assert_one_save_holds_live(tmp_path, model, opt, step, k=4, save_at=1, replay_backend="torch")


def test_replay_of_channels_last_weights_with_contiguous_state_is_exact(tmp_path):
    # The model went channels_last after its optimizer state existed: the live update mixes a
    # channels_last weight with contiguous moments, which the native kernel does not take;
    # such units are replayed by torch in the live strides, and the checkpoint is exact.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3), torch.nn.Conv2d(8, 8, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    x = torch.randn(2, 4, 12, 12)
    model(x).sum().backward()
    opt.step()
    model.to(memory_format=torch.channels_last)
    x = x.to(memory_format=torch.channels_last)

    def step() -> None:
        opt.zero_grad()
        model(x).pow(2).mean().backward()
        opt.step()

    _assert_one_save_holds_live(tmp_path, model, opt, step, k=3, save_at=2)


class _SharpnessAware(torch.optim.Optimizer):
    """SAM-like: the step moves the weights before it calls the closure, then back, then
    updates (a step rule GoCkpt does not replay). Its own update, not ``super().step()`` of a
    torch optimizer: that step is hooked too once any instance of its class exists, and the
    engine would see two updates per step."""

    def __init__(self, params, lr: float) -> None:
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        params = [p for g in self.param_groups for p in g["params"] if p.grad is not None]
        for p in params:
            p.add_(p.grad, alpha=0.05)
        with torch.enable_grad():
            closure()
        for p in params:
            p.sub_(p.grad, alpha=0.05)
            p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


def test_an_optimizer_that_moves_weights_before_its_closure_is_not_taken_for_an_edit(tmp_path):
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    opt = _SharpnessAware(model.parameters(), lr=0.1)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    x = torch.randn(4, 8)
    handles = []
    for it in range(6):
        opt.zero_grad()
        model(x).pow(2).mean().backward()

        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            return loss

        opt.step(closure)
        eng.step_end()
        if it in (1, 4):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
    eng.close()
    assert [h.result().mode for h in handles] == ["lazy", "lazy"]
    assert not eng._windows.edits_between_updates


@pytest.mark.parametrize("opt_kind", ["adamw", "subclass"])
@pytest.mark.parametrize("closure", [False, True], ids=["step", "step-with-closure"])
@pytest.mark.parametrize("mode", ["lazy", "auto", "gockpt"])
def test_a_save_requested_after_the_window_end_and_before_the_update_ends_its_window_first(
        tmp_path, mode, closure, opt_kind):
    """Explicit mode: ``before_update()`` ended the windows, then a save is requested before the
    update (a framework's later hook: Lightning's ``on_before_optimizer_step``). Its first window
    ends before the update (given a closure, when the closure returns), so the checkpoint is
    the state of its step, not a torn copy that fails. Also for an optimizer the engine does not
    replay (a subclass of AdamW: its step is not known to be AdamW's)."""
    model, opt, _, _ = make("adamw")
    if opt_kind == "subclass":
        opt = type("MyAdamW", (torch.optim.AdamW,), {})(model.parameters(), lr=1e-3)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2 if mode == "gockpt" else 1,
                                          max_overlap_steps=2, host_buffer_bytes=1 << 20),
                 explicit_before_update=True)
    g = torch.Generator().manual_seed(0)
    live, handles = {}, []

    def request() -> None:
        live[eng.version] = snapshot(model, opt)
        handles.append(eng.save(str(tmp_path / "ck")))

    for it in range(6):
        x = torch.randn(4, 8, generator=g)

        def loss_fn(x=x, it=it):
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if closure and it == 2:
                request()  # inside the closure, after the backward: as a hook the closure calls
            return loss

        if not closure:
            loss_fn()
        eng.before_update()
        if not closure and it == 2:
            request()
        opt.step(loss_fn) if closure else opt.step()
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
    eng.close()
    m = handles[0].result()
    state = gockpt.load_checkpoint(m.path)
    v = state.captured_step
    assert v == m.requested_step + (1 if mode == "gockpt" and opt_kind == "adamw" else 0)
    assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
    assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")


@pytest.mark.parametrize("field, value", [
    ("max_overlap_steps", 3.5), ("max_inflight", 2.5), ("max_inflight", True),
    ("host_buffer_bytes", 1.5), ("chunk_bytes", float("inf")), ("num_io_threads", "4"),
    ("verify_on_load", "no"), ("window_quantile", float("nan")), ("mode", None),
    ("storage_options", "{}"),
])
def test_an_option_of_the_wrong_type_is_refused_where_it_is_given(field, value):
    # Not accepted and failing later, inside the first save, with a bare TypeError.
    with pytest.raises(ValueError, match=f"^{field} must be"):
        GoCkptConfig(**{field: value})


def test_options_of_numeric_types_that_are_not_python_ints_are_accepted():
    import numpy as np

    config = GoCkptConfig(max_inflight=np.int64(3), window_quantile=np.float32(0.5), host_buffer_bytes=1e9,
                          verify_on_load=np.bool_(False), storage_options=None,
                          storage_timeout_s=float("inf"))
    assert config.max_inflight == 3 and config.window_quantile == 0.5
    assert config.host_buffer_bytes == 10**9 and type(config.host_buffer_bytes) is int
    assert config.verify_on_load is False and config.storage_options == {}
    assert config.storage_timeout_s is None  # inf: no bound


def test_a_save_abandoned_before_its_captured_step_is_overtaken_not_an_error(tmp_path):
    """``abandon_uncaptured`` (an update the engine cannot see is coming): the save still in its
    windows ends unwritten, its handle ``overtaken`` with a ``CheckpointTornError``, which
    neither ``step_end`` nor ``wait`` raises; a save already captured is written."""
    model, opt, _, _ = make()
    config = GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3, host_buffer_bytes=1 << 20)
    x = torch.randn(16, 8)

    def step():
        model(x).float().pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()

    with Engine(model, opt, config) as eng:
        step()
        early = eng.save(str(tmp_path / "early"), mode="sync")
        late = eng.save(str(tmp_path / "late"))
        assert late.captured_step is None
        assert eng.abandon_uncaptured("the test says so") == 1
        step()
        eng.wait()
    assert early.result().captured_step == 1 and not early.overtaken
    with pytest.raises(gockpt.CheckpointTornError, match="the test says so"):
        late.result()
    assert late.overtaken and not os.path.exists(tmp_path / "late")
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "early")


def test_a_directory_is_claimed_and_cleaned_once_however_its_saves_spell_it(tmp_path):
    """Saves into one local directory spelled two ways (a plain path, and a URL of another local
    protocol): the directory is claimed and its scratch files cleaned at the first save only. A
    second cleanup could remove the staging directory of the first save, still in flight,
    before its writer locked it (a save failed with FileNotFoundError)."""
    import faultfs

    model, opt, _, _ = make()
    with Engine(model, opt, GoCkptConfig(mode="sync")) as eng:
        first = eng.save(faultfs.local_url(tmp_path / "a"))
        second = eng.save(str(tmp_path / "b"))
        third = eng.save(str(tmp_path / "c"))
    assert "setup" in first.result().stall_by_phase_s
    assert "setup" not in second.result().stall_by_phase_s
    assert "setup" not in third.result().stall_by_phase_s


@pytest.mark.parametrize("optims", ["sgd", "two_adam"])
def test_a_resumed_run_moves_latest_to_its_own_checkpoints(tmp_path, optims):
    """Resumed as the README shows (``load_checkpoint(latest_checkpoint(...))``, then a new
    Engine): plain SGD has no ``step`` state (the new engine counted from 0), and two optimizers
    were counted as one (6 where the checkpoint held 12), so the resumed run's checkpoints held
    lower steps than the one it resumed from and ``latest`` stayed on that one: a crash then
    resumed from it, losing the resumed run's progress. ``latest`` now moves to them; the two
    optimizers' steps go on from the checkpoint's."""

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 1))
        if optims == "sgd":
            return m, [torch.optim.SGD(m.parameters(), lr=0.1)]
        return m, [torch.optim.Adam(m[0].parameters(), lr=0.1), torch.optim.Adam(m[1].parameters(), lr=0.1)]

    def train_(m, opts, eng, first, last):
        for i in range(first, last):
            m(torch.randn(8, 4, generator=torch.Generator().manual_seed(i))).square().mean().backward()
            for o in opts:
                o.step()
                o.zero_grad()
            eng.step_end()
            if (i + 1) % 3 == 0 or i + 1 > 6:
                eng.save(str(tmp_path / f"iter-{i + 1}"))

    m, opts = build()
    eng = Engine(m, opts, GoCkptConfig(mode="lazy"))
    train_(m, opts, eng, 0, 6)
    eng.close()
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter-6")
    state = gockpt.load_checkpoint(str(tmp_path / "iter-6"))
    m, opts = build()
    m.load_state_dict(state.model_state_dict)
    for o, sd in zip(opts, state.optimizer_state_dicts, strict=True):
        o.load_state_dict(sd)
    eng = Engine(m, opts, GoCkptConfig(mode="lazy"))
    assert eng.version == (0 if optims == "sgd" else state.captured_step)
    train_(m, opts, eng, 6, 8)
    eng.close()
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter-8")
    # Removing the newest points it at the newest of the same run, not the older run's.
    gockpt.remove_checkpoint(str(tmp_path / "iter-8"))
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter-7")
    # Without the pointer, the scan orders them the same way.
    os.unlink(tmp_path / "latest")
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "iter-7")


def test_a_rollback_a_clock_ahead_and_a_lost_pointer_keep_latest_on_the_newest_run(tmp_path):
    """``latest`` follows the newest run: a restore of an older checkpoint into the live engine
    (a rollback) starts one, whose lower steps still become ``latest``; a directory holding a
    checkpoint of a run dated in the future (its host's clock ahead) does not pin ``latest``;
    and with the pointer lost, a late save of a run never moves it back past a later one."""
    import time as _time

    from gockpt.snapshot import save_tree

    root = tmp_path / "ck"
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)

    def step():
        model(torch.randn(8, 4)).square().mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()

    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    for i in range(1, 5):
        step()
        if i in (2, 4):
            eng.save(str(root / f"s{i}"))
    eng.wait()
    assert gockpt.latest_checkpoint(str(root)) == str(root / "s4")
    eng.restore(str(root / "s2"))  # roll back
    step()
    eng.save(str(root / "r3")).result()
    assert gockpt.latest_checkpoint(str(root)) == str(root / "r3")
    eng.close()
    # A checkpoint of a run whose host's clock was an hour ahead.
    save_tree(str(root / "ahead"), {}, model=model.state_dict(), step=100,
              meta={"run": _time.time_ns() + 3600 * 10**9})
    assert gockpt.latest_checkpoint(str(root)) == str(root / "ahead")
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))  # the run resumed on another host
    step()
    first = eng.save(str(root / "n1")).result()
    step()
    eng.save(str(root / "n2")).result()
    eng.close()
    assert gockpt.latest_checkpoint(str(root)) == str(root / "n2")
    # The pointer lost (a failed write removes it), then the run's earlier save lands late.
    os.unlink(root / "latest")
    run = gockpt.storage.read_manifest(*gockpt.storage.url_to_fs(first.path, None))["meta"]["run"]
    assert not gockpt.storage.advance_latest(first.path, first.captured_step, run=run)
    assert gockpt.latest_checkpoint(str(root)) == str(root / "n2")


@pytest.mark.parametrize("mode", ["async", "lazy", "gockpt"])
def test_a_checkpoint_inside_the_folder_of_one_in_flight_leaves_both(tmp_path, mode):
    # save("ck") then, before it is published, save("ck/sub"): stock's blocking saves write
    # both; the nested one's staging folder inside ck must not stop ck's publish.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                                          update_latest=False))
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 2:
            handles.append(eng.save(str(tmp_path / "ck")))
        if it == 3:
            handles.append(eng.save(str(tmp_path / "ck" / "sub"), exact_step=True))
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    for h in handles:
        m = h.result()
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[m.captured_step]["model"])
        assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])
    assert "sub" in os.listdir(tmp_path / "ck")


def test_an_interrupted_close_leaves_no_handle_pending(tmp_path):
    # Ctrl-C while close() waits for a gradient copy in flight (gockpt_o, an emulated slow
    # link): the save still in its copy windows is cancelled and its handle resolves; nothing
    # waits on it for good.
    import signal

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=4, max_overlap_steps=4,
                                          host_link_bytes_per_s=1e5))

    def step(zero: bool = True) -> None:
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        if zero:
            opt.zero_grad()
        eng.step_end()

    for _ in range(3):
        step()
    h = eng.save(str(tmp_path / "c"))
    step(zero=False)  # a guarded gradient copy (~66 KB at 100 KB/s) in flight

    def interrupt(*_):
        raise KeyboardInterrupt

    previous = signal.signal(signal.SIGALRM, interrupt)
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.05)
        with pytest.raises(KeyboardInterrupt):
            eng.close()
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    with pytest.raises(gockpt.CheckpointCancelledError):
        h.result(timeout_s=30)
    try:  # returns, or raises that error once more; never waits out its timeout
        eng.wait(timeout_s=30)
    except gockpt.CheckpointCancelledError:
        pass
    assert not gockpt.is_complete(str(tmp_path / "c"))


def test_a_forked_child_steps_without_the_parents_engine_and_is_told_it_has_none(
        tmp_path, one_thread_fresh_selfcheck):
    # A process forked while a save copies its blocks (the copy thread stays in the parent):
    # the child's training steps do not wait for the parent's copies, and its use of the engine
    # raises a clear error; the parent's checkpoint is written as if nothing forked. (One
    # intra-op thread: torch's OpenMP pool does not survive a fork, engine or not.)
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                          host_link_bytes_per_s=2e5))
    train(model, opt, sched, scaler, 3, on_step_end=lambda it: eng.step_end())
    want = snapshot(model, opt)
    h = eng.save(str(tmp_path / "c"), exact_step=True)
    pid = os.fork()
    if pid == 0:  # the child: exit code 0 only if all of it holds
        code = 1
        try:
            train(model, opt, sched, scaler, 5, start_iter=3)
            try:
                eng.save(str(tmp_path / "child"))
            except RuntimeError as e:
                code = 0 if "forked" in str(e) else 2
            eng.close()
        finally:
            os._exit(code)
    deadline = time.monotonic() + 120
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            os.waitpid(pid, 0)
            pytest.fail("the forked child hung on the parent's engine")
        time.sleep(0.05)
    assert os.waitstatus_to_exitcode(status) == 0
    m = h.result()
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.model_state_dict, want["model"])
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"])
    assert not (tmp_path / "child").exists()
    eng.close()
