"""Writes outside optimizer.step() while a multi-step save is in its copy windows.

A block copied in an early window is brought forward by replaying later updates; an edit that
no update made (in place, or through ``.data``, which no version counter sees) would leave it
behind the live state. Each checkpoint here is compared bit for bit with the live state at its
captured step.
"""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.utils.prune

import gockpt
from gockpt import Engine, GoCkptConfig
from gockpt._watch import SAMPLES, EditWatch, ParamSampler, _sample_view
from gockpt.layout import build_layout

from _loop import assert_state_equal, make, snapshot, train


def _assert_holds_live(m, live: dict) -> None:
    """The checkpoint of ``m`` (its metrics) holds the live model and optimizer state of its
    captured step bit for bit (``live``: step -> :func:`_loop.snapshot`)."""
    state = gockpt.load_checkpoint(m.path)
    assert_state_equal(state.model_state_dict, live[m.captured_step]["model"])
    assert_state_equal(state.optimizer_state_dicts[0], live[m.captured_step]["optim"])


def _edit(params, via: str) -> None:
    with torch.no_grad():
        for p in params:
            if via == "data":  # bypasses the version counter
                p.data.mul_(0.5)
            elif via == "swap":  # a new storage
                p.data = p.data * 0.5
            else:
                p.mul_(0.5)


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("via", ["inplace", "data", "swap"])
@pytest.mark.parametrize("which", ["first", "last", "all"])
def test_an_edit_inside_the_windows_is_in_the_checkpoint(tmp_path, mode, via, which, caplog):
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=4, max_overlap_steps=4))
    params = list(model.parameters())
    edited = {"first": params[:1], "last": params[-1:], "all": params}[which]
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (1, 6):  # the save at 6 is copying blocks over steps 7..9 when the edit comes
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        if it == 7:
            _edit(edited, via)
        # The first boundary of a version (a GradScaler-skipped step has two): where it is taken.
        live.setdefault(eng.version, snapshot(model, opt))

    with caplog.at_level(logging.INFO, logger="gockpt"):
        train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
        later = eng.save(str(tmp_path / "later"))
        eng.close()
    metrics = [h.result() for h in handles]
    assert [m.mode for m in metrics] == [mode, mode]
    assert [m.captured_step - m.requested_step for m in metrics] == [3, 3]
    for m in metrics:
        _assert_holds_live(m, live)
    taken_live = any("copied at the captured step" in r.getMessage() for r in caplog.records)
    # The first parameter's block was copied before the edit: it is taken live at the capture.
    # The last one's block is copied after it, and holds it. A new storage is simply not the
    # tensor the copy was taken from (it is copied with the state tree).
    assert taken_live == (which != "last" and via != "swap")
    if via != "swap":  # the loop edits between updates: later saves copy at their request
        assert later.result().mode == "async"


def test_a_data_edit_after_a_lazy_request_fails_that_save_only(tmp_path, caplog):
    # Lazy takes the step at the request; an edit through .data while its copy runs may reach
    # the copy. The sampled contents see it: that save fails (logged, not raised to the loop),
    # the one before stands, later saves copy at their request.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    train(model, opt, sched, scaler, 3)
    eng.save(str(tmp_path / "before")).result()
    h = eng.save(str(tmp_path / "edited"))
    _edit(model.parameters(), "data")
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        train(model, opt, sched, scaler, 4, start_iter=3)
        eng.wait()
    with pytest.raises(gockpt.CheckpointTornError, match="after its step was taken"):
        h.result()
    assert not (tmp_path / "edited").exists() and gockpt.is_complete(str(tmp_path / "before"))
    assert eng.save(str(tmp_path / "after")).result().mode == "async"
    eng.close()


def test_a_data_edit_between_updates_makes_later_saves_copy_at_their_request(tmp_path):
    # No save is in flight when the loop first edits through .data; the next request is
    # copied at once, so an edit right after it (the same pattern) cannot reach its copy.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3))
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (1, 9):
            live[eng.version] = snapshot(model, opt)
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        if it >= 6:
            _edit(model.parameters(), "data")

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    first, second = (h.result() for h in handles)
    assert first.mode == "gockpt_o" and second.mode == "async"
    assert second.captured_step == second.requested_step
    state = gockpt.load_checkpoint(second.path)
    assert_state_equal(state.model_state_dict, live[second.captured_step]["model"])


def test_training_without_edits_is_not_taken_for_an_edit(tmp_path):
    # Updates, GradScaler-skipped steps (train skips iteration 5), accumulation-free SGD and
    # AdamW: no write outside an update, so saves keep their multi-step mode.
    for name in ("adamw", "sgd_nesterov"):
        model, opt, sched, scaler = make(name)
        eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
        handles = []

        def on_step_end(it: int) -> None:
            eng.step_end()
            if it % 4 == 1:
                handles.append(eng.save(str(tmp_path / f"{name}-{it}")))

        train(model, opt, sched, scaler, 14, on_step_end=on_step_end)
        eng.close()
        assert {h.result().mode for h in handles} == {"gockpt"}
        assert not eng._windows.edits_between_updates


def test_sample_views_reach_dense_tensors_only():
    t = torch.arange(1000.0)
    v = _sample_view(t, SAMPLES)
    assert v.numel() == SAMPLES
    t.add_(1.0)
    assert bool((v % 1 == 0).all()) and float(v[0]) == float(t[int(v[0]) - 1] - 1) + 1  # live memory
    cl = torch.randn(2, 3, 4, 5).contiguous(memory_format=torch.channels_last)
    v = _sample_view(cl, SAMPLES)
    assert v is not None and v.numel() == SAMPLES
    cl.data.zero_()
    assert bool((v == 0).all())  # a view of the live memory
    assert _sample_view(torch.randn(8, 8)[:, :4], SAMPLES) is None  # not one dense range
    assert _sample_view(torch.empty(0), SAMPLES) is None
    assert _sample_view(torch.tensor(3.0), SAMPLES).numel() == 1


def test_edit_watch_tells_which_units_were_written():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    layout = build_layout(model, [opt])
    w = EditWatch(layout)
    w.add(range(len(layout.units)))
    w.check()
    assert w.edited() == set()
    by_param = {id(u.param): i for i, u in enumerate(layout.units)}
    with torch.no_grad():
        model[0].weight.data[0, 0] += 1  # through .data: sampled (a 16-element tensor, all sampled)
        model[1].bias.add_(1)  # in place: its counter moves
    w.check()
    assert w.edited() == {by_param[id(model[0].weight)], by_param[id(model[1].bias)]}
    w2 = EditWatch(layout)
    w2.add(range(len(layout.units)))
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    w2.rebase()  # an update is not an edit
    w2.check()
    assert w2.edited() == set()


def test_param_sampler_sees_data_writes_only_between_updates():
    p = torch.nn.Parameter(torch.randn(100, 10))
    s = ParamSampler()
    s.check()  # before any baseline: nothing to compare
    assert not s.seen()
    s.rebase([p])
    s.check()
    assert not s.seen()
    with torch.no_grad():
        p.data.mul_(2.0)
    s.rebase([p])  # taken as an update's write
    s.check()
    assert not s.seen()
    p.data.add_(1.0)
    s.check()
    assert s.seen()


def test_param_sampler_sees_a_data_write_to_any_parameter_within_its_phases():
    # One of PHASES interleaved subsets is sampled per update: a loop writing one parameter
    # through .data between every two updates is seen within PHASES updates. Checks repeated
    # between two updates compare with the baseline of the last update, never an older one.
    params = [torch.nn.Parameter(torch.randn(64)) for _ in range(20)]
    for target in (0, 7, 13, 19):
        s = ParamSampler()
        s.rebase(params)
        updates = 0
        while not s.seen():
            s.check()
            with torch.no_grad():
                for p in params:  # an update: not an edit
                    p.data.mul_(0.5)
            s.rebase(params)
            s.check()
            s.check()
            assert not s.seen(), "an update taken for an edit"
            params[target].data.add_(1.0)  # the loop's write between updates
            s.check()
            updates += 1
            assert updates <= ParamSampler.PHASES
        assert updates >= 1


@pytest.mark.parametrize("edit_at", [2, 3])
def test_a_data_edit_of_a_frozen_parameter_is_not_held_for_later_saves(tmp_path, edit_at):
    # frozen_copy="when_changed" keeps a frozen parameter's host bytes for later saves while its
    # version counter does not move. A .data edit inside a save's windows (up to the capture) is
    # taken live for that save, and its host bytes must not be kept for the next one.
    model, _, sched, scaler = make("adamw")
    params = list(model.parameters())
    for p in params[1:]:
        p.requires_grad_(False)
    opt = torch.optim.AdamW(params, lr=1e-2)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                          frozen_copy="when_changed"))
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        if it == edit_at:
            with torch.no_grad():
                for p in params[1:]:
                    p.data.mul_(0.5)
        eng.step_end()
        if it in (1, 6):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end)
    eng.close()
    for h in handles:
        m = h.result()
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[m.captured_step]["model"], m.path)


def test_nan_parameters_are_not_taken_for_edits():
    # NaN != NaN: samples are compared as bit patterns.
    p = torch.nn.Parameter(torch.full((50,), float("nan")))
    s = ParamSampler()
    s.rebase([p])
    s.check()
    assert not s.seen()
    layout = build_layout(torch.nn.Linear(2, 2), [torch.optim.SGD([p], lr=0.1)])
    w = EditWatch(layout)
    w.add(range(len(layout.units)))
    w.check()
    assert w.edited() == set()


@pytest.mark.parametrize("then_optimizer_zero_grad", [False, True])
def test_gradients_zeroed_in_place_while_copied_fail_one_save_then_gockpt(tmp_path, caplog,
                                                                          then_optimizer_zero_grad):
    # gockpt_o copies an update's gradients while the loop goes on; module.zero_grad(
    # set_to_none=False) (not the optimizer's, which waits for the copy) zeroes them in place
    # right after the update. With a slow emulated host link the copy is still running then:
    # that checkpoint fails, logged and not raised to the loop, and later ones wait for their
    # gradient copies (gockpt) and are exact. The optimizer's zero_grad(set_to_none=False)
    # after it waits for that torn copy: its error is not raised there either.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(128, 128) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3,
                                          host_link_bytes_per_s=4e6))
    x = torch.randn(16, 128)
    live, handles = {}, []
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        for it in range(14):
            model(x).pow(2).mean().backward()
            opt.step()
            model.zero_grad(set_to_none=False)
            if then_optimizer_zero_grad:
                opt.zero_grad(set_to_none=False)
            eng.step_end()
            live.setdefault(eng.version, snapshot(model, opt))
            if it in (1, 6, 10):
                handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        eng.close()
    with pytest.raises(gockpt.CheckpointTornError, match="modified in place"):
        handles[0].result()
    assert any("mode 'gockpt' instead of 'gockpt_o'" in r.getMessage() for r in caplog.records)
    for h in handles[1:]:
        m = h.result()
        assert m.mode == "gockpt" and m.captured_step == m.requested_step + 2
        _assert_holds_live(m, live)


@pytest.mark.parametrize("how", ["closure", "explicit_closure", "explicit"])
def test_an_edit_after_the_window_end_right_before_the_update_is_in_the_checkpoint(tmp_path, how):
    # After the window end, right before the update: at the end of the closure given to
    # optimizer.step (the forward, the backward and the hooks around them run inside the step,
    # after its pre-hook; Lightning runs the module's on_before_optimizer_step there), or, in
    # explicit mode without a closure (Lightning's mixed precision runs the closure before
    # scaler.step), between before_update() and opt.step(). The edit is still in the checkpoint.
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3),
                 explicit_before_update=how != "closure")
    first = next(model.parameters())
    x = torch.randn(8, 32)
    live, handles = {}, []
    for it in range(10):
        def closure():
            opt.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            if how != "closure":
                eng.before_update()
            if it == 5:
                first.data.mul_(0.5)
            return loss

        if how == "explicit":
            closure()
            opt.step()
        else:
            opt.step(closure)
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it == 4:
            handles.append(eng.save(str(tmp_path / "ckpt")))
    eng.close()
    m = handles[0].result()
    assert m.mode == "gockpt_o" and m.captured_step == m.requested_step + 2
    _assert_holds_live(m, live)


@pytest.mark.parametrize("first", ["flush", "save"])
def test_a_save_after_a_data_swap_at_the_same_step_takes_its_own_snapshot(tmp_path, first):
    # A snapshot finished at this step (a flush, or an async save) may be shared by a later
    # request at the same step, unless the weights changed in between: an EMA-style swap-in
    # through .data moves no version counter, and the second checkpoint must hold the swapped
    # weights, as stock's would.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="async"))
    train(model, opt, sched, scaler, 4)
    if first == "flush":
        a = eng.save(str(tmp_path / "a"), mode="gockpt")
        eng.flush()
    else:
        a = eng.save(str(tmp_path / "a"))
    before = snapshot(model, opt)
    with torch.no_grad():
        for p in model.parameters():
            p.data.copy_(p.data * 0.5)  # the averaged weights, swapped in
    after = snapshot(model, opt)
    b = eng.save(str(tmp_path / "b"))
    eng.close()
    assert_state_equal(gockpt.load_checkpoint(a.result().path).model_state_dict, before["model"])
    assert_state_equal(gockpt.load_checkpoint(b.result().path).model_state_dict, after["model"])


@pytest.mark.parametrize("via", ["inplace", "data"])
def test_an_optimizer_state_edit_inside_the_windows_is_in_the_checkpoint(tmp_path, via):
    # A write to an already-copied block's optimizer state (resetting a moment estimate): the
    # replay would start from the stale copy; the unit is taken live at the capture instead.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=4, max_overlap_steps=4))
    first = next(model.parameters())
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 6:
            handles.append(eng.save(str(tmp_path / "ckpt")))
        if it == 7:
            state = opt.state[first]["exp_avg"]
            with torch.no_grad():
                (state.data if via == "data" else state).zero_()
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    m = handles[0].result()
    assert m.mode == "gockpt" and m.captured_step == m.requested_step + 3
    _assert_holds_live(m, live)


@pytest.mark.parametrize("change", ["delete_buffer", "buffer_to_double", "buffer_reshaped",
                                    "delete_frozen_parameter", "prune_made_permanent"])
@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_buffer_removed_or_recast_inside_a_saves_windows_is_checkpointed_as_it_is_then(
        tmp_path, mode, change):
    # A save's slot is laid out at its request. A buffer or frozen parameter removed, or
    # replaced by one of another dtype or shape, before the captured step (a cast, pruning
    # made permanent, which turns weight_orig and weight_mask back into a plain weight) failed
    # the save and raised into the loop. The checkpoint holds the model as it is at the
    # captured step: the key gone, or its new tensor.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.Linear(16, 16))
    model.register_buffer("count", torch.zeros(4))
    model.register_parameter("frozen", torch.nn.Parameter(torch.ones(3), requires_grad=False))
    torch.nn.utils.prune.l1_unstructured(model[1], "weight", amount=0.25)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    x = torch.randn(8, 16)
    live, handles = {}, []
    for it in range(8):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        if it == 3:  # inside the windows of the save requested at the end of step 2
            if change == "delete_buffer":
                del model.count
            elif change == "buffer_to_double":
                model.count = model.count.double() + 1
            elif change == "buffer_reshaped":
                model.count = torch.arange(6.0)
            elif change == "delete_frozen_parameter":
                del model.frozen
            else:
                torch.nn.utils.prune.remove(model[1], "weight")
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it in (2, 5):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
    eng.close()
    for h in handles:
        m = h.result()
        assert m.captured_step == m.requested_step + 2
        _assert_holds_live(m, live)


@pytest.mark.parametrize("between", ["flush", "persist_held", "none"])
@pytest.mark.parametrize("mode", ["lazy", "async", "gockpt"])
def test_a_second_save_at_one_step_after_a_batch_norm_forward_holds_the_new_statistics(
        tmp_path, monkeypatch, mode, between):
    # A train-mode forward of a batch norm updates its running statistics in place without
    # moving their version counters (a calibration pass between two saves of one step). The
    # second save must not share the first one's snapshot, whose buffers were taken before:
    # neither at the request ("persist_held": the first one's shard writes are held, so its
    # snapshot is still there to share), nor after a flush (which pinned the snapshot anew).
    import threading

    import faultfs

    release = threading.Event()
    fault = faultfs.Fault()
    if between == "persist_held":
        fault.hang({"write"}, until=release)
    monkeypatch.setattr(faultfs.FaultLocalFileSystem, "fault", fault)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                                          max_inflight=2, host_buffer_bytes=1 << 24))
    x = torch.randn(8, 8)
    live, handles = {}, {}
    for it in range(6):
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        if it == 2:
            live["a"] = snapshot(model, opt)
            handles["a"] = eng.save(faultfs.local_url(tmp_path / "a"), exact_step=True)
            if between == "flush":
                eng.flush()
            with torch.no_grad():
                model(torch.randn(8, 8) * 3 + 1)  # running_mean/var and num_batches_tracked move
            live["b"] = snapshot(model, opt)
            assert not torch.equal(live["a"]["model"]["1.running_mean"], live["b"]["model"]["1.running_mean"])
            handles["b"] = eng.save(str(tmp_path / "b"), exact_step=True)
            release.set()
    eng.close()
    for name, h in handles.items():
        state = gockpt.load_checkpoint(h.result().path)
        assert_state_equal(state.model_state_dict, live[name]["model"], name)
        assert_state_equal(state.optimizer_state_dicts[0], live[name]["optim"], name)


class _FailingGrad(torch.Tensor):
    """A gradient whose use by the optimizer raises, while ``armed``: an update that stops
    after writing the parameters before this one (SGD with ``foreach=False`` goes one by one)."""

    armed = False

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        if cls.armed and getattr(func, "__name__", "") in ("add_", "add", "mul_", "clone"):
            raise RuntimeError("the update failed midway")
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("where", ["inside_the_update", "after_the_update"])
@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_run_stopped_midway_through_a_step_writes_no_torn_checkpoint(tmp_path, caplog, mode, where):
    # A save requested at step 2 is captured two updates later. At step 4 the optimizer raises
    # after updating some parameters (inside_the_update), or the scheduler's step raises after
    # the update and before step_end (after_the_update); the loop ends and close() finishes
    # the saves in flight. The live tensors are no step's state there: that save fails with
    # a warning (CheckpointTornError), is not written, and the checkpoint before it stands
    # (of step 1, each save in a host slot of its own).
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                                          max_inflight=2, host_buffer_bytes=1 << 22))
    live, handles = {}, []
    with caplog.at_level(logging.WARNING, logger="gockpt"), pytest.raises(RuntimeError, match="failed midway"):
        try:
            for step in range(1, 7):
                opt.zero_grad()
                model(torch.randn(4, 8)).pow(2).mean().backward()
                last = list(model.parameters())[-1]
                if step == 4 and where == "inside_the_update":
                    last.grad = last.grad.as_subclass(_FailingGrad)
                    _FailingGrad.armed = True
                try:
                    opt.step()
                finally:
                    _FailingGrad.armed = False
                if step == 4 and where == "after_the_update":
                    raise RuntimeError("the scheduler step failed midway")
                eng.step_end()
                live.setdefault(eng.version, snapshot(model, opt))
                if step in (1, 2):
                    handles.append(eng.save(str(tmp_path / f"ckpt-{step}"), exact_step=step == 1))
        finally:
            eng.close()
    _assert_holds_live(handles[0].result(), live)  # the one before (captured at step 1)
    with pytest.raises(gockpt.CheckpointTornError, match="not written"):
        handles[1].result()
    assert not gockpt.is_complete(str(tmp_path / "ckpt-2"))
    assert any("not written" in r.getMessage() for r in caplog.records)


def test_a_loop_that_ends_after_an_update_without_step_end_still_gets_its_checkpoint(tmp_path):
    # A loop that breaks after its last update and scheduler step, before the next step_end
    # (no exception): close() captures the save in flight there, the step the loop ended at.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    live, handles = {}, []
    for step in range(1, 5):
        opt.zero_grad()
        model(torch.randn(4, 8)).pow(2).mean().backward()
        opt.step()
        live[eng.version] = snapshot(model, opt)
        if step == 4:
            break
        eng.step_end()
        if step == 2:
            handles.append(eng.save(str(tmp_path / "ckpt-2")))
    eng.close()
    m = handles[0].result()
    assert m.captured_step == 4 == eng.version
    _assert_holds_live(m, live)


def test_an_uncaught_exception_after_an_update_writes_no_torn_checkpoint_at_exit(tmp_path):
    # The engine is never closed: the exit handler finishes the save in flight after the
    # uncaught exception (raised after update 3 and before its step_end) has been printed.
    # The live state there is no step's: the save is not written; the one before it is.
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent(f"""
        import torch, gockpt
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh(), torch.nn.Linear(8, 4))
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(
            mode="gockpt", min_overlap_steps=3, max_overlap_steps=3, max_inflight=2,
            host_buffer_bytes=1 << 22))
        for step in range(1, 6):
            opt.zero_grad()
            model(torch.randn(4, 8)).pow(2).mean().backward()
            opt.step()
            if step == 3:
                raise RuntimeError("the scheduler step failed")
            eng.step_end()
            if step in (1, 2):
                eng.save({str(tmp_path)!r} + f"/ckpt-{{step}}", exact_step=step == 1)
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1 and "the scheduler step failed" in proc.stderr, proc.stderr[-2000:]
    assert "ckpt-2: not written" in proc.stderr, proc.stderr[-2000:]
    assert gockpt.is_complete(str(tmp_path / "ckpt-1"))
    assert not gockpt.is_complete(str(tmp_path / "ckpt-2"))


@pytest.mark.parametrize("loop", ["raises_before_the_update", "no_step_end", "flush_after_a_forward"])
@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_capture_after_the_next_forward_holds_the_buffers_of_its_step(tmp_path, mode, loop):
    # A batch norm's forward moves its running statistics (without a version bump). A save
    # requested at step 2 is to be captured at step 4; the capture comes at step 3 or 4 after
    # the next step's forward has run: an exception between backward and the update, with
    # close() in a finally (raises_before_the_update); a loop without step_end, captured at the
    # next update's window end (no_step_end); a flush the loop makes right after a forward
    # (flush_after_a_forward). The checkpoint holds the buffers of its captured step, as a
    # blocking save there does, not the moved ones.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.BatchNorm1d(16), torch.nn.Tanh(),
                                torch.nn.Linear(16, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    live, handles = {}, []
    stop = 4 if loop == "raises_before_the_update" else None
    try:
        for step in range(1, 7):
            opt.zero_grad()
            loss = model(torch.randn(8, 8) * step).pow(2).mean()
            if loop == "flush_after_a_forward" and step == 4:
                eng.flush()
            loss.backward()
            if step == stop:
                raise RuntimeError("the loop failed before the update")
            opt.step()
            if loop != "no_step_end":
                eng.step_end()
            live[eng.version] = snapshot(model, opt)
            if step == 2:
                handles.append(eng.save(str(tmp_path / "ckpt-2")))
    except RuntimeError as e:
        assert stop is not None and "before the update" in str(e)
    finally:
        eng.close()
    m = handles[0].result()
    # Where the next step's forward had run: after it (3), at the next update's window end (4).
    assert m.captured_step == (4 if loop == "no_step_end" else 3), m.captured_step
    state = gockpt.load_checkpoint(m.path)
    forwards = int(state.model_state_dict["1.num_batches_tracked"])  # one per step
    assert forwards == m.captured_step, f"{forwards} forwards: buffers of a later one"
    _assert_holds_live(m, live)


@pytest.mark.parametrize("mode", ["lazy", "gockpt"])
def test_a_save_requested_inside_an_update_that_then_fails_midway_is_not_written_torn(tmp_path, caplog, mode):
    # A save requested inside the optimizer's step, after the window end (a hook the closure
    # calls: Lightning's on_before_optimizer_step), then the update raises after writing some
    # parameters. A save captured at its request (lazy) holds the state before the update; a
    # multi-step one, still to be captured, fails as torn and is not written.
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, foreach=False)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=2 if mode == "gockpt" else 1,
                                          max_overlap_steps=2, host_buffer_bytes=1 << 20),
                 explicit_before_update=True)
    before, handles = {}, []
    with caplog.at_level(logging.WARNING, logger="gockpt"), pytest.raises(RuntimeError, match="failed midway"):
        try:
            for it in range(6):
                x = torch.randn(4, 8)

                def closure(it=it, x=x):
                    opt.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    eng.before_update()
                    if it == 2:
                        before.update(snapshot(model, opt))
                        handles.append(eng.save(str(tmp_path / "ck")))
                        last = list(model.parameters())[-1]
                        last.grad = last.grad.as_subclass(_FailingGrad)
                        _FailingGrad.armed = True
                    return loss

                try:
                    opt.step(closure)
                finally:
                    _FailingGrad.armed = False
                eng.step_end()
        finally:
            eng.close()
    if mode == "lazy":
        _assert_holds_live(handles[0].result(), {2: before})
    else:
        with pytest.raises(gockpt.CheckpointTornError, match="inside an optimizer update"):
            handles[0].result()
        assert not gockpt.is_complete(str(tmp_path / "ck"))


@pytest.mark.parametrize("marks", ["every", "some"])
def test_the_last_block_is_copied_after_the_capture_reads_its_edit_check(tmp_path, monkeypatch, marks):
    # The capture at a step boundary reads the edit check back (a host sync on a GPU); a read
    # queued behind the last block's copy would wait for all of it. So in a loop that marks its
    # step boundaries, that copy is queued right after the read, not at the update before. A
    # loop that marks some steps only (here: the request's) gets no boundary at the captured
    # step: its copy is queued at the update, to overlap the next forward and backward.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=3, max_overlap_steps=3))
    events: list[str] = []
    edited = EditWatch.edited

    def spy_edited(self, host_only: bool = False):
        events.append("read")
        return edited(self, host_only)

    monkeypatch.setattr(EditWatch, "edited", spy_edited)
    copier = eng._windows._copier
    copy = copier.copy
    params = {p.data_ptr() for p in model.parameters()}
    buffers = {b.data_ptr() for b in model.buffers()}
    assert buffers

    def spy_copy(pairs, priority, *a, **kw):
        if priority == gockpt.transfer.PRIORITY_STATE and any(src.data_ptr() in params for src, _ in pairs):
            events.append(f"copy@{eng.version}")
        if any(src.data_ptr() in buffers for src, _ in pairs):
            events.append("buffers")  # the capture's copy of the buffers
        return copy(pairs, priority, *a, **kw)

    monkeypatch.setattr(copier, "copy", spy_copy)
    # After the engine's own post-hook: the update the engine has just counted.
    opt.register_step_post_hook(lambda *_: events.append(f"update@{eng.version}"))
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        if marks == "every" or it == 6:
            eng.step_end()
        if it == 6:
            events.append("request")
            handles.append(eng.save(str(tmp_path / "ckpt")))
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    m = handles[0].result()
    assert (m.mode, m.captured_step - m.requested_step) == ("gockpt_o", 2)
    after = events[events.index("request"):]
    copies = [e for e in after if e.startswith("copy@")]
    assert len(copies) == 3  # one block per window
    assert copies[-1] == f"copy@{m.captured_step}"
    if marks == "every":
        _assert_holds_live(m, live)
        # After the capture's read and its copy of the buffers, none of which waits for it.
        assert after.index(copies[-1]) > after.index("read")
        assert after.index(copies[-1]) > after.index("buffers")
    else:  # in the update's post-hook, not at the next window end
        assert after.index(copies[-1]) < after.index(f"update@{m.captured_step}") < after.index("read")


@pytest.mark.parametrize("how", ["data_edit", "no_step_end", "flush"])
def test_a_save_whose_last_window_waits_for_the_boundary_is_exact(tmp_path, how):
    # The last window opens at the captured step's boundary: an edit of its block before that
    # boundary is in its copy; a step without a boundary opens it at the next update's window
    # end; a flush between the update and the boundary copies it then.
    model, opt, sched, scaler = make("adamw")
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    params = list(model.parameters())
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        if it == 8 and how == "data_edit":  # after the captured step's update, before its boundary
            _edit(params[-1:], "data")
        if it == 8 and how == "flush":
            eng.flush()
        live.setdefault(eng.version, snapshot(model, opt))
        if it == 8 and how == "no_step_end":
            return
        eng.step_end()
        if it == 6:
            handles.append(eng.save(str(tmp_path / "ckpt")))

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    m = handles[0].result()
    assert m.mode == "gockpt"
    assert m.captured_step - m.requested_step == 2
    if how != "no_step_end":
        _assert_holds_live(m, live)
        return
    # Taken at the next update's window end (warned): the buffers are those after that step's
    # forward, as documented; the parameters and optimizer state are the captured step's.
    state = gockpt.load_checkpoint(m.path)
    names = {n for n, _ in model.named_parameters()}
    want = live[m.captured_step]
    assert_state_equal({k: v for k, v in state.model_state_dict.items() if k in names},
                       {k: v for k, v in want["model"].items() if k in names})
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"])


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("module", ["hidden", "norm"])
@pytest.mark.parametrize("assign", [False, True], ids=["in_place", "assign"])
def test_a_submodule_loaded_inside_the_windows_is_in_the_checkpoint_of_that_step(
        tmp_path, mode, module, assign):
    # A step that ends by loading weights into part of the model (a target network's sync, a
    # teacher refreshed from a file): the checkpoint of that step holds them, as a blocking save
    # at its end does, whether the load writes in place or swaps in new tensors (assign=True).
    model, opt, sched, scaler = make("adamw")
    torch.manual_seed(5)
    source = getattr(make("adamw", seed=5)[0], module).state_dict()
    eng = Engine(model, opt, GoCkptConfig(mode=mode, min_overlap_steps=4, max_overlap_steps=4))
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 6:  # copying blocks over steps 7..9 when the load comes
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        if it in (7, 8):
            getattr(model, module).load_state_dict(source, assign=assign)
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    m = handles[0].result()
    assert m.captured_step - m.requested_step == 3
    _assert_holds_live(m, live)


@pytest.mark.parametrize("then", ["optimizer_load", "flush", "wait", "next_step"])
def test_a_submodule_load_after_the_boundary_then_a_capture_holds_its_buffers_too(tmp_path, then):
    # A load into a batch norm (parameters and running statistics) after the step's boundary,
    # then a capture at that step (an optimizer load, flush or wait), or at the next one: the
    # buffers stashed at the boundary are not that step's any more; the checkpoint holds the
    # loaded parameters and buffers together, as a blocking save right there does.
    model, opt, sched, scaler = make("adamw")
    src = make("adamw", seed=5)[0]
    with torch.no_grad():
        src.norm.running_mean.add_(3.0)
        src.norm.running_var.mul_(2.0)
    source = src.norm.state_dict()
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt", min_overlap_steps=4, max_overlap_steps=4))
    handles, live = [], {}

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 6:
            handles.append(eng.save(str(tmp_path / "ckpt")))
        if it == 7:
            model.norm.load_state_dict(source)
            live[eng.version] = snapshot(model, opt)
            if then == "optimizer_load":
                opt.load_state_dict(opt.state_dict())
            elif then == "flush":
                eng.flush()
            elif then == "wait":
                eng.wait()
        live.setdefault(eng.version, snapshot(model, opt))

    train(model, opt, sched, scaler, 12, on_step_end=on_step_end)
    eng.close()
    m = handles[0].result()
    assert m.captured_step == m.requested_step + (3 if then == "next_step" else 1)
    _assert_holds_live(m, live)
