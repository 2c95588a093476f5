"""GPU probe (scripts/gpu_probe_steps.py MODE [K]): each step and pinned allocation around four
saves of a 1.2 GB fp32 AdamW model over steps of about 8 ms; where a mode's extra wall time goes."""
import json, statistics, sys, tempfile, time
import torch
from torch import nn
import gockpt, gockpt._direct as D

allocs = []
_orig = D.host_empty
def host_empty(nbytes, *, pin_memory=False):
    t = time.perf_counter(); out = _orig(nbytes, pin_memory=pin_memory)
    allocs.append((STEP[0], nbytes, time.perf_counter() - t, pin_memory)); return out
D.host_empty = host_empty
import gockpt.transfer as T
if hasattr(T, "host_empty"): T.host_empty = host_empty
STEP = [0]
mode = sys.argv[1]; k = int(sys.argv[2]) if len(sys.argv) > 2 else 1
torch.set_num_threads(8); torch.manual_seed(0)
W = 4096; layers = max(1, round(1.2e9 / (3 * 4 * (W * W + W))))
model = nn.Sequential(*[nn.Linear(W, W) for _ in range(layers)]).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
x = torch.randn(256, W, device="cuda")
def step():
    model(x).square().mean().backward(); opt.step(); opt.zero_grad(set_to_none=False)
    torch.cuda.current_stream().synchronize()
step()
eng = gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode=mode, min_overlap_steps=k))
times, reqs, handles = [], [], []
with tempfile.TemporaryDirectory() as root:
    for i in range(3 + 200 * 4 + 50):
        STEP[0] = i
        t0 = time.perf_counter(); step()
        if i == 2: eng.save(f"{root}/w"); eng.wait()
        if i >= 202 and (i - 202) % 200 == 0 and len(handles) < 4:
            reqs.append(i); handles.append(eng.save(f"{root}/s{i}"))
        times.append(time.perf_counter() - t0)
    eng.wait()
    ms = [h.result() for h in handles]
    eng.close()
clean = statistics.median(times[3:])
print(f"{mode} K>={k}: clean {clean*1e3:.2f} ms, extra/ckpt {(sum(times[203:]) - len(times[203:])*clean)/len(ms)*1e3:.1f} ms")
for r, m in zip(reqs, ms):
    slow = [(i - r, round(times[i] * 1e3, 1)) for i in range(r, min(r + 30, len(times))) if times[i] > 1.5 * clean]
    print(f" req@{r}: K={m.num_overlap_steps} stall={m.stall_s*1e3:.1f}ms dev_wait={m.device_wait_s} pred={m.predicted_stall_s*1e3:.1f} phases={ {a: round(b*1e3,1) for a,b in m.stall_by_phase_s.items()} } slow(offset,ms)={slow}")
print(" allocs(step, MB, s, pinned):", [(a, round(b/1e6), round(c, 3), p) for a, b, c, p in allocs])
