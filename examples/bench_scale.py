"""Checkpoint cost per GB at several state sizes, the engine alone (no Lightning layer).

For each size (default about 0.3, 1.2 and 3 GB of weights + AdamW state, fp32) and each scheme,
a fresh process trains a stack of ``Linear`` layers (one training thread) and checkpoints every
``--interval`` steps:

- ``none``: no checkpoint (the baseline step time and memory);
- ``torch.save``: a blocking ``torch.save`` of the model and optimizer state_dicts + fsync;
- ``gockpt <mode>``: :class:`gockpt.Engine` driven directly (``engine.save`` after the step).

One checkpoint during the warm-up steps is not measured (buffer allocation happens once). Printed
per row, medians over the checkpoints: the training thread's extra wall time per
checkpoint (sum of step times minus steps x the median step of the same process's steps with
no checkpoint in flight), the engine-reported stall, the time from request to durable, and the
peak RSS above the ``none`` run of the same size; each also per GB of checkpointed state.
This machine is shared: quote ratios, run it twice. With ``--device cuda`` the model, batch and
optimizer state live on the GPU, each step ends by synchronizing the current stream (as a loop
that reads its loss with ``.item()`` does; a device-wide ``torch.cuda.synchronize()`` would also
wait for GoCkpt's copy streams), and GoCkpt copies over its own CUDA streams into pinned host memory: the
D2H copy itself is measured, not emulated. Usage::

    python examples/bench_scale.py --sizes-gb 0.3 1.2 3 --modes lazy gockpt_o
    python examples/bench_scale.py --device cuda --batch 4096 --sizes-gb 1.2 3
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

WIDTH = 2048


def _layers(size_gb: float) -> int:
    # AdamW keeps exp_avg and exp_avg_sq beside each fp32 parameter: state = 3 x weights.
    per_layer = 3 * 4 * (WIDTH * WIDTH + WIDTH)
    return max(1, round(size_gb * 1e9 / per_layer))


def _run(args: argparse.Namespace) -> dict:
    import torch
    from torch import nn

    import gockpt

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    device = torch.device(args.device)
    model = nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(_layers(args.size_gb))]).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5)
    state_bytes = 3 * sum(p.numel() * p.element_size() for p in model.parameters())
    x = torch.randn(args.batch, WIDTH, device=device)
    sync = (lambda: torch.cuda.current_stream().synchronize()) if device.type == "cuda" else (lambda: None)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        sync()

    step()  # AdamW state exists from here on
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    engine = None
    if args.scheme.startswith("gockpt "):
        engine = gockpt.Engine(model, opt, gockpt.GoCkptConfig(
            mode=args.scheme.split()[1], min_overlap_steps=args.min_overlap_steps))
    times, in_flight, handles, durable, stall = [], [], [], [], []
    plans: list[dict] = []
    with tempfile.TemporaryDirectory(dir=args.dir) as root:
        # The measured saves come every --interval steps from the warm-up save on: the engine
        # estimates the steps to the next request from the gaps between requests, and a first
        # gap of one step made it expect the next request after one step (and so plan K = 1,
        # or charge a flush of the windows left at that request) for the first saves.
        first = args.warmup - 1 + args.interval

        def due(i: int) -> bool:
            return i >= first and (i - first) % args.interval == 0 and args.scheme != "none"

        total = first + args.checkpoints * args.interval + args.interval
        for i in range(total):
            t0 = time.perf_counter()
            step()
            if engine is not None:
                # The step's boundary, marked as the Lightning and Accelerate adapters mark it:
                # a multi-step save takes its state there, not at the next update's window end.
                engine.step_end()
            if i == args.warmup - 1 and engine is not None:
                # One unmeasured checkpoint: one-time set-up (the host snapshot's allocation,
                # pinned on CUDA: about 0.6 s per GB) is not a per-checkpoint cost.
                engine.save(f"{root}/warmup")
                engine.wait()
            if due(i) and len(durable) + len(handles) < args.checkpoints:
                path = f"{root}/step-{i}"
                if engine is None:
                    t = time.perf_counter()
                    with open(path, "wb") as f:
                        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, f)
                        f.flush()
                        os.fsync(f.fileno())
                    durable.append(time.perf_counter() - t)
                else:
                    handles.append(engine.save(path))
            busy = engine is not None and any(not h.done() for h in handles)
            times.append(time.perf_counter() - t0)
            in_flight.append(busy or (engine is None and due(i)))
        if engine is not None:
            engine.wait()
            for h in handles:
                m = h.result()
                durable.append(m.time_to_durable_s)
                stall.append(m.stall_s)
                plans.append({"k": m.num_overlap_steps, "predicted_s": m.predicted_stall_s,
                              "slot_wait_s": m.predicted_slot_wait_s,
                              "replay_wait_s": m.predicted_replay_wait_s,
                              "bound_s": m.stall_lower_bound_s, "phases": m.stall_by_phase_s,
                              "host_peak_bytes": m.host_peak_bytes,
                              "device_wait_s": m.device_wait_s})
            engine.close()
    measured = times[args.warmup:]
    flags = in_flight[args.warmup:]
    clean = statistics.median([t for t, f in zip(measured, flags, strict=True) if not f] or measured)
    busy_steps = [t for t, f in zip(measured, flags, strict=True) if f]
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    phases = sorted({k for pl in plans for k in pl["phases"]})
    n = max(1, args.checkpoints if args.scheme != "none" else 1)
    return {
        "scheme": args.scheme, "size_gb": args.size_gb, "state_bytes": state_bytes,
        "device_name": torch.cuda.get_device_name() if device.type == "cuda" else None,
        "cores": os.cpu_count(),
        "clean_step_s": clean,
        "extra_per_ckpt_s": (sum(measured) - len(measured) * clean) / n,
        "stall_s": statistics.median(stall) if stall else None,
        "durable_s": statistics.median(durable) if durable else None,
        "rss_peak_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "rss_start_bytes": rss0,
        # The steps with a checkpoint in flight (its copy windows and its persist), seconds.
        "in_flight_step_s": med(busy_steps),
        "in_flight_step_max_s": max(busy_steps) if busy_steps else None,
        "clean_steps": len(measured) - len(busy_steps),
        "k": med([pl["k"] for pl in plans]),
        "predicted_stall_s": med([pl["predicted_s"] for pl in plans]),
        # Of it, the wait for the slot the save before is still writing out.
        "predicted_slot_wait_s": med([pl["slot_wait_s"] for pl in plans]),
        # Of it, the waits for gradient buffers the CPU replay still holds (grad_buffer).
        "predicted_replay_wait_s": med([pl["replay_wait_s"] for pl in plans]),
        "stall_lower_bound_s": med([pl["bound_s"] for pl in plans]),
        "stall_by_phase_s": {ph: med([pl["phases"].get(ph, 0.0) for pl in plans]) for ph in phases},
        "host_peak_bytes": med([pl["host_peak_bytes"] for pl in plans]),
        # CUDA: the compute stream's waits for copies at window ends (not in the host's stall).
        "device_wait_s": med([pl["device_wait_s"] for pl in plans]),
    }


def print_tables(rows: list[dict], args: argparse.Namespace) -> None:
    """Print the cost table and the engine table of ``rows`` (one dict per finished row)."""
    where = args.device
    if rows and rows[0].get("device_name"):
        where = f"{rows[0]['device_name']} (training on the GPU)"
    elif args.device.startswith("cuda"):
        where = "a CUDA device (training on the GPU)"
    cores = rows[0].get("cores") if rows else None
    cores = cores or (None if args.from_rows else os.cpu_count())
    print(f"{where}, {cores or 'unrecorded'} cores, {args.threads} training thread(s), batch {args.batch}; "
          f"state = fp32 weights + AdamW state; "
          f"{args.checkpoints} checkpoints every {args.interval} steps; medians"
          + (f"; multi-step modes at K >= {args.min_overlap_steps}." if args.min_overlap_steps > 1
             else "."))
    print("| size (GB) | scheme | clean step (s) | extra wall / ckpt (s) | per GB (s/GB) | "
          "engine stall (s) | durable (s) | durable per GB (s/GB) | peak RSS above none (GB) | "
          "per GB of state |")
    print("|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    base = {r["size_gb"]: r["rss_peak_bytes"] for r in rows if r["scheme"] == "none"}
    fmt = lambda v, d=3: "-" if v is None else f"{v:.{d}f}"  # noqa: E731
    for r in rows:
        gb = r["state_bytes"] / 1e9
        extra_mem = (r["rss_peak_bytes"] - base[r["size_gb"]]) / 1e9 if r["size_gb"] in base else None
        print(f"| {gb:.2f} | {r['scheme']} | {r['clean_step_s']:.3f} | {r['extra_per_ckpt_s']:.3f} | "
              f"{r['extra_per_ckpt_s'] / gb:.3f} | {fmt(r['stall_s'])} | {fmt(r['durable_s'], 2)} | "
              f"{fmt(None if r['durable_s'] is None else r['durable_s'] / gb, 2)} | {fmt(extra_mem, 2)} | "
              f"{fmt(None if extra_mem is None else extra_mem / gb, 2)} |")
    engine_rows = [r for r in rows if r["scheme"].startswith("gockpt ")]
    if engine_rows:
        # Where the stall goes, and whether the copy hid under the steps: a step with a
        # checkpoint in flight against a clean one of the same process.
        print()
        # "clean steps": how many steps the clean median is taken over (none: all steps, and
        # the ratios are 1 by construction).
        print("| size (GB) | scheme | K | predicted stall (s) | of which slot wait (s) | "
              "of which replay wait (s) | lower bound (s) | "
              "measured stall (s) | stall by phase (s) | in-flight step / clean step (median, max) | "
              "clean steps | host peak (ckpt sizes) |")
        print("|---:|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|")
        for r in engine_rows:
            gb = r["state_bytes"] / 1e9
            by_phase = ", ".join(f"{k} {v:.3f}" for k, v in r["stall_by_phase_s"].items() if v >= 5e-4)
            if (r.get("device_wait_s") or 0.0) >= 5e-4:  # not in the measured stall: the device's
                by_phase += f"; on the device: window_end {r['device_wait_s']:.3f}"
            ratio = "-" if r["in_flight_step_s"] is None else (
                f"{r['in_flight_step_s'] / r['clean_step_s']:.2f}, "
                f"{r['in_flight_step_max_s'] / r['clean_step_s']:.2f}")
            peak = None if r["host_peak_bytes"] is None else r["host_peak_bytes"] / r["state_bytes"]
            print(f"| {gb:.2f} | {r['scheme']} | {fmt(r['k'], 0)} | {fmt(r['predicted_stall_s'])} | "
                  f"{fmt(r['predicted_slot_wait_s'])} | {fmt(r.get('predicted_replay_wait_s'))} | "
                  f"{fmt(r['stall_lower_bound_s'])} | {fmt(r['stall_s'])} | {by_phase or '-'} | {ratio} | "
                  f"{r['clean_steps']} | {fmt(peak, 2)} |")



def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sizes-gb", type=float, nargs="+", default=[0.3, 1.2, 3.0])
    p.add_argument("--modes", nargs="+", default=["lazy", "gockpt_o", "auto"])
    p.add_argument("--checkpoints", type=int, default=3)
    p.add_argument("--interval", type=int, default=5, help="steps between checkpoints")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--dir", default=None, help="where checkpoints are written (default: tmp)")
    p.add_argument("--device", default="cpu", help="where the model trains: cpu or cuda")
    p.add_argument("--batch", type=int, default=8, help="rows of the input batch")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads of training")
    p.add_argument("--min-overlap-steps", type=int, default=1,
                   help="GoCkptConfig.min_overlap_steps of the multi-step modes (e.g. 7 with "
                        "--modes gockpt_o: the replay's gradient-buffer waits, measured beside "
                        "their prediction)")
    p.add_argument("--no-baselines", action="store_true",
                   help="skip the 'none' and 'torch.save' rows (the engine's rows only; RSS "
                        "above none is then not given)")
    p.add_argument("--from-rows", nargs="+", default=None, metavar="LOG",
                   help="only print the tables of the '# done:' rows in these stderr logs (rows of "
                        "runs cut off by a time limit, or of several calls, in one table)")
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child: scheme,size
    args = p.parse_args()
    if args.from_rows:
        rows = [json.loads(line.split(": ", 2)[2]) for log in args.from_rows
                for line in open(log, encoding="utf-8") if line.startswith("# done: ")]
        print_tables(rows, args)
        return
    if args.one:
        args.scheme, size = args.one.rsplit(",", 1)
        args.size_gb = float(size)
        print(json.dumps(_run(args)))
        return
    rows = []
    for size in args.sizes_gb:
        baselines = [] if args.no_baselines else ["none", "torch.save"]
        for scheme in [*baselines, *[f"gockpt {m}" for m in args.modes]]:
            cmd = [sys.executable, __file__, "--one", f"{scheme},{size}", "--checkpoints",
                   str(args.checkpoints), "--interval", str(args.interval), "--warmup", str(args.warmup),
                   "--device", args.device, "--batch", str(args.batch), "--threads", str(args.threads),
                   "--min-overlap-steps", str(args.min_overlap_steps)]
            if args.dir:
                cmd += ["--dir", args.dir]
            out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
            rows.append(json.loads(out.strip().splitlines()[-1]))
            # Each row as it ends: a run stopped at a time limit keeps the rows it finished.
            print(f"# done: {scheme} at {size} GB: {json.dumps(rows[-1])}", file=sys.stderr, flush=True)
    print_tables(rows, args)

if __name__ == "__main__":
    main()
