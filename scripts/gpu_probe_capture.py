"""Probe (scripts/gpu_probe_capture.py MODE K DEVICE [GB] [BATCH]): where a multi-step save's
stall goes. Trains an fp32 AdamW MLP of about GB gigabytes of state through `Engine`, one
warm-up save and four measured ones 200 steps apart (20 on a CPU; PROBE_EVERY sets it), and
* profiles (cProfile) every call of the windows' capture at the measured saves: the capture's
  share of each save's stall and the functions that took its time;
* logs the costs each save was planned with (copy rate, step period, replay rate), the replay
  wait predicted from them, the measured `grad_buffer` wait, the steps' real period during the
  save and the replay rate the replay thread measured, and the replay wait predicted again
  from those measured inputs: which input the prediction got wrong;
* logs each host buffer allocation (step, MB, seconds).
A probe, not a test: it wraps private methods to time them."""
import cProfile
import dataclasses
import io
import os
import pstats
import statistics
import sys
import tempfile
import time

import torch
from torch import nn

import gockpt
import gockpt.transfer
from gockpt import _direct, _planner, _windows
from gockpt import plan as P

mode, k, dev = sys.argv[1], int(sys.argv[2]), sys.argv[3]
gb = float(sys.argv[4]) if len(sys.argv) > 4 else 1.2
batch = int(sys.argv[5]) if len(sys.argv) > 5 else 256
# "step_end": the loop marks each step's end (Engine.step_end, as the adapters do), so the
# capture is taken at the step boundary rather than at the next update's window end.
marks = len(sys.argv) > 6 and sys.argv[6] == "step_end"
cuda = dev == "cuda"
W = 4096 if cuda else 1024
prof, on, calls = cProfile.Profile(), [False], []
STEP, plans, allocs = [0], [], []
_capture_orig = _windows.Windows._capture
_plan_orig = _planner.Planner.plan
_costs_orig = _planner.Planner._costs
_empty_orig = _direct.host_empty


def capture(self, s, version, *a, **kw):
    if not on[0]:
        return _capture_orig(self, s, version, *a, **kw)
    t = time.perf_counter()
    prof.enable()
    try:
        return _capture_orig(self, s, version, *a, **kw)
    finally:
        prof.disable()
        calls.append((version, s.window, time.perf_counter() - t))


def plan(self, layout, *a, **kw):
    out = _plan_orig(self, layout, *a, **kw)
    plans.append((STEP[0], out, layout, self._last_costs))
    return out


def costs(self, *a, **kw):
    self._last_costs = out = _costs_orig(self, *a, **kw)
    return out


def host_empty(nbytes, *, pin_memory=False):
    t = time.perf_counter()
    out = _empty_orig(nbytes, pin_memory=pin_memory)
    allocs.append((STEP[0], round(nbytes / 1e6), round(time.perf_counter() - t, 3), pin_memory))
    return out


_windows.Windows._capture = capture
_planner.Planner.plan, _planner.Planner._costs = plan, costs
_direct.host_empty = host_empty
if hasattr(gockpt.transfer, "host_empty"):
    gockpt.transfer.host_empty = host_empty
torch.set_num_threads(8 if cuda else 2)
torch.manual_seed(0)
layers = max(1, round(gb * 1e9 / (3 * 4 * (W * W + W))))
model = nn.Sequential(*[nn.Linear(W, W) for _ in range(layers)]).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
x = torch.randn(batch, W, device=dev)


def step():
    model(x).square().mean().backward()
    opt.step()
    opt.zero_grad(set_to_none=False)
    if cuda:
        torch.cuda.current_stream().synchronize()


step()
eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=mode, min_overlap_steps=k))
every = int(os.environ.get("PROBE_EVERY", 200 if cuda else 20))
times, handles = [], []
with tempfile.TemporaryDirectory() as root:
    for i in range(3 + every * 4 + 20):
        STEP[0] = i
        t0 = time.perf_counter()
        step()
        if marks and i >= 2:
            eng.step_end()
        if i == 2:
            eng.save(f"{root}/w")
            eng.wait()
            on[0] = True
        if i >= 2 + every and (i - 2 - every) % every == 0 and len(handles) < 4:
            handles.append(eng.save(f"{root}/s{i}"))
        times.append(time.perf_counter() - t0)
    eng.wait()
    ms = [h.result() for h in handles]
    samples = list(eng._pipeline._replay_samples)
    eng.close()
print(f"{mode} K>={k} on {dev}{' with step_end' if marks else ''}: {layers} layers of {W}, "
      f"clean step {statistics.median(times[3:]) * 1e3:.2f} ms")
for m in ms:
    print(f" K={m.num_overlap_steps} stall={m.stall_s * 1e3:.1f} ms phases=",
          {a: round(b * 1e3, 1) for a, b in m.stall_by_phase_s.items()})
rate = sum(n for n, _ in samples) / max(sum(t for _, t in samples), 1e-9)
print(f" replay thread: {len(samples)} replays, {rate / 1e9:.2f} GB/s of state "
      f"(per replay MB/ms: {[(round(n / 1e6), round(t * 1e3, 1)) for n, t in samples[-8:]]})")
measured = [(st, pl, lay, c) for st, pl, lay, c in plans if st > 2]
for m, (st, pl, lay, c) in zip(ms, measured, strict=False):
    k = pl.num_overlap_steps
    period = statistics.mean(times[st + 1:st + k + 1]) if k > 1 else 0.0
    ub = [u.state_bytes for u in lay.units]
    gbs = [u.grad_bytes if u.param.requires_grad else 0 for u in lay.units]
    if c is None:
        print(f" save@{st}: K={k}, planned without costs")
        continue
    again_rate = P.replay_wait_s(pl.mode, ub, gbs, pl.blocks, dataclasses.replace(c, replay_bytes_per_s=rate))
    again_both = P.replay_wait_s(pl.mode, ub, gbs, pl.blocks,
                                 dataclasses.replace(c, replay_bytes_per_s=rate, step_s=period))
    print(f" save@{st}: K={k} blocks(MB)={[round(sum(ub[i] for i in b) / 1e6) for b in pl.blocks]} "
          f"costs: copy {c.copy_bytes_per_s / 1e9:.1f} GB/s, step {c.step_s * 1e3:.1f} ms, window "
          f"{c.window_s * 1e3:.1f} ms, replay {c.replay_bytes_per_s / 1e9:.2f} GB/s, backlog "
          f"{c.replay_backlog_s * 1e3:.1f} ms | replay wait predicted {m.predicted_replay_wait_s * 1e3:.1f} ms, "
          f"measured grad_buffer {m.stall_by_phase_s.get('grad_buffer', 0) * 1e3:.1f} ms; real period "
          f"{period * 1e3:.1f} ms; predicted again with the measured replay rate "
          f"{again_rate * 1e3:.1f} ms, with it and the real period {again_both * 1e3:.1f} ms")
print(" host allocations (step, MB, s, pinned):", allocs)
print(" capture calls (step, window, ms):", [(v, w, round(t * 1e3, 2)) for v, w, t in calls])
out = io.StringIO()
st = pstats.Stats(prof, stream=out).sort_stats("cumulative")
st.print_stats(30)
out.write("\n--- by own time ---\n")
st.sort_stats("tottime").print_stats(15)
print(out.getvalue())
