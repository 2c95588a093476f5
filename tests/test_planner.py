"""The planner's wiring: what the engine passes the pure planner, and plans sized per window
checkpoint exactly what a blocking save holds."""

from __future__ import annotations

import math
import time
from time import perf_counter
from types import SimpleNamespace

import pytest
import torch
from _loop import assert_state_equal, make, snapshot, train

import gockpt
from gockpt import Engine, GoCkptConfig
from gockpt._planner import Planner
from gockpt._windows import MODELLED_PHASES
from gockpt.layout import build_layout
from gockpt.plan import Costs, make_plan, predict_stall_s


def _frozen_model():
    """The test loop's net with its hidden layer frozen (in the optimizer, never a gradient)."""
    model, opt, sched, scaler = make("adamw")
    model.hidden.weight.requires_grad_(False)
    return model, opt, sched, scaler


def test_planner_counts_no_gradient_for_frozen_parameters_and_the_static_copy():
    model, opt, sched, scaler = _frozen_model()
    train(model, opt, sched, scaler, 2)  # optimizer state exists
    planner = Planner(model, [opt], GoCkptConfig(), SimpleNamespace(rate_sample=lambda: (0, 0.0)), 1000.0)
    layout, _ = planner.current_layout()
    plan = planner.plan(layout, "gockpt_o", False, None, version=2, window_s=0.5)
    units = [u.state_bytes for u in layout.units]
    grads = [0 if u.param is model.hidden.weight else u.grad_bytes for u in layout.units]
    assert sum(grads) < sum(u.grad_bytes for u in layout.units)
    static = sum(e.spec.nbytes for e in layout.static)
    assert static > 0  # BatchNorm statistics and the step counter buffer
    want = make_plan("gockpt_o", units, grads, Costs(1000.0, 0.5), max_overlap_steps=7,
                     replayable=True, static_bytes=static)
    assert plan == want
    assert plan.predicted_stall_s == pytest.approx(predict_stall_s(
        "gockpt_o", units, grads, plan.blocks, Costs(1000.0, 0.5), static_bytes=static))
    assert 0 < plan.lower_bound_s <= plan.predicted_stall_s


def test_the_layout_of_an_optimizer_over_frozen_parameters_keeps_them_as_units():
    model, opt, sched, scaler = _frozen_model()
    train(model, opt, sched, scaler, 2)
    frozen = [u for u in build_layout(model, [opt]).units if u.param is model.hidden.weight]
    assert len(frozen) == 1 and not frozen[0].state_entries  # AdamW made no state for it


@pytest.mark.parametrize("mode", ["gockpt_o", "auto"])
def test_per_window_blocks_equal_a_blocking_save(tmp_path, monkeypatch, mode):
    # Costs as over a link where one copy spans 3 windows: the planner sizes the blocks per
    # window; the frozen parameter is copied in its block and never replayed.
    model, opt, sched, scaler = _frozen_model()
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    monkeypatch.setattr(Planner, "_costs", lambda self, w, *_: Costs(1000.0, state_bytes / 3000.0))
    config = GoCkptConfig(mode=mode, max_overlap_steps=4, host_buffer_bytes=1 << 20,
                          max_shard_bytes=2048)
    eng = Engine(model, opt, config)
    live, handles = {}, []

    def on_step_end(it: int) -> None:
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it in (2, 8):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 16, on_step_end=on_step_end)
    eng.close()
    metrics = [h.result() for h in handles]
    for m in metrics:
        assert m.mode == "gockpt_o" and m.num_overlap_steps > 1 and m.grad_bytes > 0
        assert 0.0 <= m.stall_lower_bound_s <= m.predicted_stall_s
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert v == m.requested_step + m.num_overlap_steps - 1
        assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")
    # Same costs and layout, so the same plan: the second save's prediction and bound are the
    # first's plus the per-save fixed cost measured on the first (none was known before it).
    first, second = metrics
    fixed = second.predicted_stall_s - first.predicted_stall_s
    assert fixed > 0.0
    assert second.stall_lower_bound_s - first.stall_lower_bound_s == pytest.approx(fixed, abs=1e-12)
    # That fixed cost is the first save's stall outside the modelled phases (its request and
    # capture, its version checks), not its one-time setup (the directory claim, the layout,
    # the replay self-check), which the second save had none of.
    by = first.stall_by_phase_s
    assert by["setup"] > 0.0 and "setup" not in second.stall_by_phase_s
    assert by["request"] > 0.0 and by["window_check"] > 0.0
    named = sum(by.get(p, 0.0) for p in ("request", "capture", "window_check", "slot_wait"))
    assert fixed == pytest.approx(named, abs=1e-12) == pytest.approx(_fixed(first), abs=1e-12)
    assert fixed < first.stall_s - by["setup"] + 1e-12
    assert torch.equal(model.hidden.weight, live[max(live)]["model"]["hidden.weight"])


def _saves_with_equal_plans(tmp_path, monkeypatch, modes: dict[int, str]) -> list:
    """Metrics of saves at the given steps in the given modes, with the planner's costs fixed
    (so saves in one mode get equal plans: their predictions differ by the fixed cost alone),
    each durable before the next request (past its K <= 4 windows), so that it gets the
    same host slot back."""
    model, opt, sched, scaler = make("adamw")
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    monkeypatch.setattr(Planner, "_costs", lambda self, w, *_: Costs(1000.0, state_bytes / 3000.0))
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", max_overlap_steps=4,
                                          host_buffer_bytes=1 << 20, max_shard_bytes=2048))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it - 5 in modes:
            handles[-1].result()
        if it in modes:
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}"), mode=modes[it]))

    train(model, opt, sched, scaler, max(modes) + 6, on_step_end=on_step_end)
    eng.close()
    ms = [h.result() for h in handles]
    assert [m.mode for m in ms] == list(modes.values())
    return ms


def _fixed(m) -> float:
    """A save's fixed cost as the engine counts it: its stall outside setup and the phases the
    stall model predicts."""
    return m.stall_s - sum(m.stall_by_phase_s.get(p, 0.0) for p in ("setup", *MODELLED_PHASES))


def test_a_save_into_a_fresh_slot_stops_counting_once_a_warm_one_is_measured(tmp_path, monkeypatch):
    # The first save faults its new host buffers in and builds the slot's views: its request
    # costs more than any later one. Its fixed cost stands in only until a save into the warm
    # slot is measured; from then on the prediction rests on warm saves alone.
    first, second, third = _saves_with_equal_plans(tmp_path, monkeypatch,
                                                   {2: "gockpt_o", 8: "gockpt_o", 14: "gockpt_o"})
    assert first.num_overlap_steps == second.num_overlap_steps == third.num_overlap_steps > 1
    fixed = [_fixed(first), _fixed(second)]
    # Before any warm save: the cold one's cost (the first save predicted none).
    assert second.predicted_stall_s - first.predicted_stall_s == pytest.approx(fixed[0], abs=1e-12)
    # After one: the warm save's alone, not the median of both.
    assert third.predicted_stall_s - first.predicted_stall_s == pytest.approx(fixed[1], abs=1e-12)
    assert fixed[0] != fixed[1]


def test_the_fixed_cost_in_a_prediction_is_that_of_saves_in_the_same_mode(tmp_path, monkeypatch):
    # A multi-step request does more on the training thread than a lazy one (gradient buffers,
    # blocks sized per window): `auto` switching between them must not predict one with the
    # other's cost. The first save into a fresh slot (each mode's first here) stands in only
    # while nothing warm is known.
    modes = {2: "lazy", 8: "gockpt_o", 14: "lazy", 20: "gockpt_o", 26: "lazy", 32: "gockpt_o"}
    ms = _saves_with_equal_plans(tmp_path, monkeypatch, modes)
    assert len({m.num_overlap_steps for m in ms[1::2]}) == 1 and ms[1].num_overlap_steps > 1
    f = [_fixed(m) for m in ms]
    lazy = [m.predicted_stall_s - ms[0].predicted_stall_s for m in ms[0::2]]
    over = [m.predicted_stall_s - ms[1].predicted_stall_s + f[0] for m in ms[1::2]]
    assert over[0] == lazy[1] == pytest.approx(f[0], abs=1e-12)  # only the cold first save known
    assert over[1] == pytest.approx(f[2], abs=1e-12)  # a warm lazy save beats a cold gockpt_o one
    assert lazy[2] == pytest.approx(f[2], abs=1e-12)  # lazy's own
    assert over[2] == pytest.approx(f[3], abs=1e-12)  # gockpt_o's own, not lazy's
    assert f[3] != f[2]


def test_cost_samples_hold_cold_values_only_until_a_warm_one():
    from gockpt._windows import CostSamples

    s = CostSamples(maxlen=3)
    assert s.median() is None
    s.add(9.0, cold=True)
    s.add(7.0, cold=True)
    assert s.median() == 8.0  # nothing better known yet
    s.add(1.0, cold=False)
    assert s.median() == 1.0 and len(s) == 1
    s.add(50.0, cold=True)  # a later cold save (a regrown slot): not recorded
    s.add(3.0, cold=False)
    s.add(2.0, cold=False)
    s.add(4.0, cold=False)  # the oldest warm value leaves
    assert s.median() == 3.0 and len(s) == 3
    s.add(12.0, cold=False)  # skewed: the mean, which predictions use, moves; the median less
    assert s.median() == 4.0 and s.mean() == pytest.approx(6.0)


def test_the_fixed_cost_predicted_is_the_mean_of_the_warm_saves(tmp_path, monkeypatch):
    # The prediction is of the mean stall, and the fixed cost is skewed (a request that meets a
    # busy second core takes longer): a median of three warm saves would under-predict it.
    ms = _saves_with_equal_plans(tmp_path, monkeypatch, {s: "gockpt_o" for s in (2, 8, 14, 20, 26)})
    assert len({m.num_overlap_steps for m in ms}) == 1
    f = [_fixed(m) for m in ms]
    assert ms[4].predicted_stall_s - ms[0].predicted_stall_s == pytest.approx(
        (f[1] + f[2] + f[3]) / 3, abs=1e-12)


def _deep(width: int = 8):
    """24 equal parameters: a copy splits into windows finely (the test loop's net is one large
    parameter and a few small ones). Input and output width 8, as the test loop feeds it."""
    torch.manual_seed(0)
    sizes = [8] + [width] * 23 + [8]
    model = torch.nn.Sequential(*[m for i in range(24) for m in (
        torch.nn.Linear(sizes[i], sizes[i + 1], bias=False), torch.nn.Tanh())])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + 0.1 * s))
    return model, opt, sched, torch.amp.GradScaler("cpu", init_scale=2.0**8)


def _every(tmp_path, monkeypatch, interval: int, copy_windows: float, saves: int = 4,
           link: float | None = None, width: int = 8):
    """Metrics of ``saves`` checkpoints requested every ``interval`` updates, the planner's costs
    fixed so that a full copy of the state spans ``copy_windows`` windows (the default host
    pool of one slot; ``link``: an emulated host link, bytes/s); each checkpoint checked bit
    for bit against the live state at its captured step. Also the seconds each request took."""
    model, opt, sched, scaler = _deep(width)
    state_bytes = sum(p.numel() * 4 * 3 for p in model.parameters())
    monkeypatch.setattr(Planner, "_costs", lambda self, w, *_: Costs(
        1000.0, state_bytes / 1000.0 / copy_windows))
    eng = Engine(model, opt, GoCkptConfig(mode="auto", max_overlap_steps=7,
                                          host_link_bytes_per_s=link))
    live, handles, calls = {}, [], []

    def on_step_end(it: int) -> None:
        eng.step_end()
        live.setdefault(eng.version, snapshot(model, opt))
        if it >= 2 and (it - 2) % interval == 0 and len(handles) < saves:
            t0 = perf_counter()
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
            calls.append(perf_counter() - t0)

    train(model, opt, sched, scaler, 2 + interval * saves + 8, on_step_end=on_step_end,
          skip_iter=-1)
    eng.close()
    ms = [h.result() for h in handles]
    for m in ms:
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert v == m.requested_step + m.num_overlap_steps - 1
        assert_state_equal(state.model_state_dict, live[v]["model"], f"{m.path}:model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{m.path}:optim@{v}")
    assert [m.expected_interval_steps for m in ms] == [None] + [interval] * (saves - 1)
    return ms, calls


def test_a_save_ends_its_windows_a_step_before_the_next_request(tmp_path, monkeypatch):
    # Without the next request in view the plan takes K = 6; with a request every 6 steps its
    # windows would end right at it, and that request would wait for the slot to be written.
    (first, *rest), _ = _every(tmp_path, monkeypatch, interval=6, copy_windows=8)
    assert first.num_overlap_steps == 6
    assert all(m.num_overlap_steps == 5 and not m.host_shared for m in rest)
    assert all(m.predicted_stall_s > first.predicted_stall_s - 1e-9 for m in rest[1:])


def test_a_save_cut_short_by_the_next_request_is_shared_with_it(tmp_path, monkeypatch):
    # A request every 2 steps, a copy spanning 3 windows (gradients aside): the plan keeps a
    # third window that the next request cuts short. That request copies the rest, captures
    # the state at its own step and shares the snapshot.
    # An emulated link of 8 MB/s: the copy that request makes (a third of the 1.1 MB of state,
    # the last update's gradients of the rest) takes about 0.07 s when steps are fast.
    ms, calls = _every(tmp_path, monkeypatch, interval=2, copy_windows=3, saves=4, link=8e6,
                       width=64)
    # The first save (no interval known: K = 7) is cut short the same way; the third is
    # planned with the request in view.
    assert ms[1].host_shared and ms[1].captured_step == ms[1].requested_step
    leader, joiner = ms[2], ms[3]
    assert leader.num_overlap_steps == 3 and "flush" in leader.stall_by_phase_s
    assert joiner.host_shared and leader.host_shared
    assert joiner.captured_step == leader.captured_step == joiner.requested_step
    # The joiner copies nothing: its prediction is the per-save fixed cost, and the flush is
    # the leader's stall alone, not counted again as the joiner's wait for a slot.
    assert "flush" not in joiner.stall_by_phase_s
    assert joiner.predicted_stall_s == joiner.stall_lower_bound_s < leader.predicted_stall_s
    # What both count for the joiner's request is the time that request took: counted once,
    # and all of it (the wait for the gradient copies in flight included).
    # (How much the flush itself copies depends on how far the third window's copy got in
    # the step before: on a loaded machine it may be done.)
    counted = leader.stall_by_phase_s["flush"] + joiner.stall_s
    assert 0.8 * calls[3] <= counted <= calls[3]


def test_a_flush_counts_its_capture_once(tmp_path):
    # A save cut short before its captured step: the flush copies the rest and takes the state
    # now. Its phases add up to no more than the call that finished it.
    model, opt, sched, scaler = _deep()
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", max_overlap_steps=7,
                                          min_overlap_steps=7))
    handles, took = [], []

    def slow_state() -> dict:
        time.sleep(0.05)
        return {"epoch": 0}

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == 3:
            # A slow state_fn: the capture inside the flush takes a while.
            handles.append(eng.save(str(tmp_path / "ckpt"), state_fn=slow_state))
        elif it == 5:
            t0 = perf_counter()
            eng.flush()
            took.append(perf_counter() - t0)

    train(model, opt, sched, scaler, 6, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    m = handles[0].result()
    by = m.stall_by_phase_s
    assert m.num_overlap_steps == 3 and by["flush"] > 0 and by["capture"] >= 0.05
    at_flush = by["flush"] + by["capture"] + by.get("static_copy", 0.0)
    assert at_flush <= took[0]


@pytest.mark.parametrize("slow_link", [True, False])
def test_each_window_reports_how_early_its_copy_ended(tmp_path, slow_link):
    # The planner learns each window's overhead from when its copy ended against the window
    # end (metrics.window_margins_s). A link far slower than the steps: the window
    # that copies much ends late (the planner puts most of the copy in the last window), and
    # the training thread waited at least that long at its window end. A fast link and long
    # steps: every copy ends well inside its window.
    model, opt, sched, scaler = _deep(width=64)  # about 1.2 MB of state
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", max_overlap_steps=4,
                                          min_overlap_steps=4,
                                          host_link_bytes_per_s=2e6 if slow_link else None))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (2, 9):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))
        if not slow_link:
            time.sleep(0.05)  # inside every window, the first's too: 50 ms for a copy of < 1 MB

    train(model, opt, sched, scaler, 16, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    for m in (h.result() for h in handles):
        assert m.num_overlap_steps == 4 and len(m.window_margins_s) == 4
        waited = sum(max(0.0, -x) for x in m.window_margins_s)
        assert m.stall_by_phase_s["window_end"] >= waited
        if slow_link:  # 1.2 MB at 2 MB/s, in windows of a few ms (or 100 ms on a loaded machine)
            assert m.window_margins_s[-1] < -0.1 and waited > 0.1
        else:
            assert all(x > 0 for x in m.window_margins_s)
            # The window the plan sized its blocks for holds the 50 ms each step sleeps.
            assert m.planned_window_s is not None and m.planned_window_s >= 0.05


def test_sync_saves_report_no_planned_window(tmp_path):
    # A sync save copies at its request: it has no copy window, even once windows are measured.
    model, opt, sched, scaler = _deep(width=16)
    eng = Engine(model, opt, GoCkptConfig(mode="sync"))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 6):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 8, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    assert [h.result().planned_window_s for h in handles] == [None, None]


def test_window_overheads_of_warm_saves_reach_the_planner(tmp_path, monkeypatch):
    # Each window a warm save ran gives the planner one overhead sample; a save into a fresh
    # host slot (the first) gives none, though its margins are reported.
    seen = []

    def spy(self, window_s, samples=(), step_s=None):
        # Fixed rate and window, the samples passed through: the first two saves get the same
        # plan and so the same gradient buffers (a save whose plan needs larger ones is cold).
        seen.append(samples)
        return Costs(1e9, 1.0, overhead_samples_s=samples)

    monkeypatch.setattr(Planner, "_costs", spy)
    model, opt, sched, scaler = _deep(width=64)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", max_overlap_steps=3,
                                          min_overlap_steps=3, host_link_bytes_per_s=50e6))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 9, 15):
            if handles:
                handles[-1].result()  # durable: the next save gets the same (warm) slot
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 20, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    first, second, third = (h.result() for h in handles)
    assert [m.num_overlap_steps for m in (first, second, third)] == [3, 3, 3]
    assert [m.planned_window_s for m in (first, second, third)] == [1.0, 1.0, 1.0]  # the spy's
    assert len(first.window_margins_s) == 3 and len(second.window_margins_s) == 3
    assert len(seen) == 3 and seen[0] == () and seen[1] == ()  # the cold save gave none
    assert len(seen[2]) == 3 and all(math.isfinite(x) for x in seen[2])


def test_window_forecast_is_the_quantile_asked_for():
    from gockpt._windows import window_forecast

    windows = [0.3, 0.1, 0.2, 0.5, 0.4]
    assert window_forecast(windows, 0.5) == 0.3  # the median
    assert window_forecast([0.1, 0.2, 0.4, 0.3], 0.5) == pytest.approx(0.25)
    assert window_forecast(windows, 0.0) == 0.1 and window_forecast(windows, 1.0) == 0.5
    assert window_forecast(windows, 0.25) == pytest.approx(0.2)
    assert window_forecast(windows, 0.125) == pytest.approx(0.15)  # between order statistics
    assert window_forecast([0.7], 0.1) == 0.7
    with pytest.raises(ValueError, match="at least one"):
        window_forecast([], 0.5)
    with pytest.raises(ValueError, match="q must be in"):
        window_forecast(windows, 1.5)
    with pytest.raises(ValueError, match="window_quantile"):
        GoCkptConfig(window_quantile=1.5)
    with pytest.raises(ValueError, match="window_memory"):
        GoCkptConfig(window_memory=0)


@pytest.mark.parametrize("options, short_steps, slow_steps, above", [
    # A few short windows, then a slow stretch (each slow window sleeps 0.08 s) right before
    # the request: the lowest quantile plans for a short window, the highest for a slow one.
    ({"window_quantile": 0.0}, 4, 11, False),
    ({"window_quantile": 1.0}, 4, 11, True),
    # At the default quantile (0.25): a memory of 4 sees only the 8 slow windows, a memory of
    # 30 mostly the 16 short ones before them.
    ({"window_memory": 4}, 16, 8, True),
    ({"window_memory": 30}, 16, 8, False),
])
def test_plans_are_sized_for_the_configured_forecast_of_recent_windows(
        tmp_path, options, short_steps, slow_steps, above):
    model, opt, sched, scaler = _deep(width=16)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy", **options))
    handles = []
    request = short_steps + slow_steps

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it == request:
            handles.append(eng.save(str(tmp_path / "ckpt")))
        time.sleep(0.08 if short_steps <= it < request else 0.0)

    train(model, opt, sched, scaler, request + 2, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    planned = handles[0].result().planned_window_s
    assert planned is not None
    assert (planned >= 0.08) == above, planned


class _IssueCopier:
    """A copier that does its work inside ``copy()`` and hands back a finished ticket, as a
    CUDA copy issued on a fast stream can be: the host's clock sees it only before the call
    returns."""

    def __init__(self, seconds: float, timed_s: float = 0.0) -> None:
        self.seconds = seconds
        self.timed_s = timed_s  # what it says each copy took on its own clock (0: not timed)
        self.done, self.busy = 0, 0.0

    def copy(self, pairs, priority, check_versions=False):
        for src, dst in pairs:
            dst.copy_(src)
            self.done += dst.numel() * dst.element_size()
        self.busy += self.timed_s
        time.sleep(self.seconds)
        return SimpleNamespace(wait=lambda: None)

    def rate_sample(self):
        return self.done, self.busy


def test_copy_bandwidth_probe_times_the_copy_from_before_it_is_issued():
    from gockpt._planner import probe_copy_bandwidth

    copier = _IssueCopier(0.02)
    bw = probe_copy_bandwidth(copier, torch.device("cpu"), None)
    # 8 MiB in at least 20 ms: at most about 0.42 GB/s, however fast the host's clock reads the
    # finished ticket.
    assert bw <= (8 << 20) / 0.02, bw
    assert probe_copy_bandwidth(copier, torch.device("cpu"), 1e6) == 1e6  # the cap still holds


def test_copy_bandwidth_probe_takes_the_copiers_own_timing_of_the_copy():
    # A CUDA copier times each copy between events on its stream; the host's clock around the
    # call also counts the launch and the event wait (a third of an 8 MiB copy on an H200).
    from gockpt._planner import probe_copy_bandwidth

    copier = _IssueCopier(0.02, timed_s=0.004)
    assert probe_copy_bandwidth(copier, torch.device("cpu"), None) == pytest.approx((8 << 20) / 0.004)
    # A timing longer than the call itself is not this copy's alone: the wall clock stands.
    copier = _IssueCopier(0.005, timed_s=1.0)
    assert probe_copy_bandwidth(copier, torch.device("cpu"), None) <= (8 << 20) / 0.005


def test_planner_takes_the_pace_measured_on_finished_copies_over_the_probe():
    model, opt, sched, scaler = make("adamw")
    train(model, opt, sched, scaler, 2)
    sample = [(0, 0.0)]
    copier = SimpleNamespace(rate_sample=lambda: sample[0])
    planner = Planner(model, [opt], GoCkptConfig(), copier, 1e12)
    layout, _ = planner.current_layout()
    plan = planner.plan(layout, "gockpt_o", False, None, version=2, window_s=0.5)
    assert plan.copy_bytes_per_s == 1e12  # too little copying seen: the probe's figure
    sample[0] = (3_000_000, 0.1)  # 30 MB/s, measured over 0.1 s of copying
    plan = planner.plan(layout, "gockpt_o", False, None, version=3, window_s=0.5)
    assert plan.copy_bytes_per_s == pytest.approx(3e7)


@pytest.fixture
def planned_costs(monkeypatch) -> list:
    """The costs each plan is made from, in order (None before any was measured)."""
    seen: list = []
    original = Planner._costs

    def spy(self, *args, **kwargs):
        costs = original(self, *args, **kwargs)
        seen.append(costs)
        return costs

    monkeypatch.setattr(Planner, "_costs", spy)
    return seen


def test_the_measured_replay_rate_and_step_period_reach_the_plan(tmp_path, planned_costs):
    # The replay thread times each update it replays; the planner's costs carry that rate (state
    # bytes per second) and the step period, so that a plan whose captures would wait for a
    # gradient buffer is charged for it (gockpt.plan.replay_wait_s).
    seen = planned_costs
    model, opt, sched, scaler = _deep(width=384)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=5, max_overlap_steps=5))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 10, 17, 24, 31):
            if handles:
                handles[-1].result()  # its replays are done and timed
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 38, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    ms = [h.result() for h in handles]
    assert all(m.num_overlap_steps == 5 and m.grad_bytes > 0 for m in ms)
    costed = [c for c in seen if c is not None]
    # Before the first replay the self-check's pace on its timing probe stands in; then the
    # replays' own.
    probe = gockpt.selfcheck.select_backend(opt, "auto").replay_bytes_per_s
    assert probe > 0.0 and costed and costed[0].replay_bytes_per_s == probe
    assert costed[-1].replay_bytes_per_s not in (0.0, probe) and costed[-1].step_s > 0.0
    rate, step = costed[-1].replay_bytes_per_s, costed[-1].step_s
    assert 1e6 < rate < 1e13 and step > 0.0
    assert all(m.predicted_replay_wait_s >= 0.0 for m in ms)


def test_a_k_agreed_with_other_ranks_is_planned_and_priced_as_this_rank_runs_it():
    # A sharded engine's ranks follow one (mode, K) (gockpt.sharded): where it differs from this
    # rank's own choice, the blocks are sized per window for that K, and the prediction (window
    # loads, replay waits) is that of the plan run, not of the plan this rank would have chosen.
    model, opt, sched, scaler = _deep()
    train(model, opt, sched, scaler, 2)
    layout = build_layout(model, [opt])
    units = [u.state_bytes for u in layout.units]
    grads = [u.grad_bytes for u in layout.units]
    static = sum(e.spec.nbytes for e in layout.static)
    costs = Costs(1e5, 0.05, replay_bytes_per_s=sum(units) / 5, step_s=0.06)
    asked = []

    def planner(agree):
        p = Planner(model, [opt], GoCkptConfig(min_overlap_steps=7, max_overlap_steps=7),
                    SimpleNamespace(rate_sample=lambda: (0, 0.0)), costs.copy_bytes_per_s,
                    replay_bytes_per_s=lambda: costs.replay_bytes_per_s)
        p.agree = agree
        return p

    def plan(p):
        return p.plan(p.current_layout()[0], "gockpt_o", False, None, version=2,
                      window_s=costs.window_s, step_s=costs.step_s)

    own = plan(planner(lambda pl: (asked.append(pl), (pl.mode, pl.num_overlap_steps))[1]))
    assert asked == [own] and own.num_overlap_steps == 7
    agreed = plan(planner(lambda pl: ("gockpt_o", 4)))
    assert agreed.mode == "gockpt_o" and agreed.num_overlap_steps == 4
    want = make_plan("gockpt_o", units, grads, costs, max_overlap_steps=4, min_overlap_steps=4,
                     replayable=True, static_bytes=static, next_request_shares=False)
    assert agreed.blocks == want.blocks and agreed.blocks != own.blocks[:4]
    assert agreed.predicted_stall_s == pytest.approx(predict_stall_s(
        "gockpt_o", units, grads, agreed.blocks, costs, static_bytes=static))
    assert agreed.replay_wait_s == pytest.approx(gockpt.plan.replay_wait_s(
        "gockpt_o", units, grads, agreed.blocks, costs)) and agreed.replay_wait_s > 0.0
    assert agreed.predicted_stall_s != own.predicted_stall_s
    assert agreed.lower_bound_s == own.lower_bound_s  # over every K this rank allows
    lazy = plan(planner(lambda pl: ("lazy", 1)))
    assert lazy.mode == "lazy" and lazy.blocks == (tuple(range(len(units))),)
    assert lazy.predicted_stall_s == pytest.approx(predict_stall_s(
        "lazy", units, grads, lazy.blocks, costs, static_bytes=static))


def test_replays_still_queued_at_a_request_reach_its_plan(tmp_path, planned_costs):
    # Two host slots and a slow replay (emulated): the second save is requested while the
    # first one's replays are still queued; its costs carry them (Costs.replay_backlog_s).
    # Each update's replay sleeps several steps long, so that the queue at a request does not
    # depend on how fast this machine steps.
    seen = planned_costs
    model, opt, sched, scaler = _deep(width=64)
    state = sum(p.numel() * 4 * 3 for p in model.parameters())  # AdamW: param + two moments
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=4, max_overlap_steps=4,
                                          host_buffer_bytes=64 << 20, max_inflight=2,
                                          replay_bytes_per_s=state / 3))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 7, 11):
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 16, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    assert all(h.result().num_overlap_steps == 4 for h in handles)
    backlogs = [c.replay_backlog_s for c in seen if c is not None]
    assert backlogs and backlogs[0] == 0.0  # nothing queued before the first save
    assert max(backlogs) > 0.01, backlogs  # later requests found earlier replays queued


def test_replays_done_leave_no_backlog_for_later_plans(tmp_path, planned_costs):
    # Each replay takes its bytes off the queued backlog when it ends: saves far apart (every
    # replay of one done before the next request) plan with none, however many came before.
    seen = planned_costs
    model, opt, sched, scaler = _deep(width=64)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", min_overlap_steps=4, max_overlap_steps=4))
    handles = []

    def on_step_end(it: int) -> None:
        eng.step_end()
        if it in (3, 9, 15, 21):
            eng.wait()  # every replay of the save before is done
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}")))

    train(model, opt, sched, scaler, 26, on_step_end=on_step_end, skip_iter=-1)
    eng.close()
    assert all(h.result().num_overlap_steps == 4 for h in handles)
    backlogs = [c.replay_backlog_s for c in seen if c is not None]
    assert len(backlogs) >= 3 and backlogs == [0.0] * len(backlogs), backlogs
