"""Timeline of GoCkpt's background work against the training steps, for ``benchmark.py``.

The engine records its background phases when :mod:`gockpt._trace` is on (per thread: copy,
replay, serialize, write, checksum, fsync, manifest, publish, latest; wall and CPU time). This
module turns those events and the measured step times into three answers:

- step times during a checkpoint (steps that started while one was in flight, its own step
  excluded) against steps without one: medians and their ratio, from the same process;
- the timeline of one checkpoint: per thread and phase, first start and last end after the
  request, busy wall time, CPU time, count and bytes, and the thread's CPU time between its
  phases (Python, which holds the GIL; the phases themselves call code that releases it);
- which phase slows steps: for each phase, the median time of the steps it overlapped for at
  least half of the step, against the median step without a checkpoint.
"""

from __future__ import annotations

import statistics
from collections import defaultdict

PHASES = ("copy", "replay", "serialize", "write", "checksum", "fsync", "manifest", "publish",
          "latest")


def in_flight_indices(starts: list[float], ckpt_steps: list[int], requests: list[float],
                      durable_at: list[float]) -> list[int]:
    """Indices of the measured steps that started while a checkpoint was in flight (after its
    request, before it was durable), each checkpoint's own step excluded."""
    return [i for i, s in enumerate(starts)
            if i not in ckpt_steps
            and any(r <= s < d for r, d in zip(requests, durable_at, strict=False))]


def in_flight_steps(times: list[float], starts: list[float], ckpt_steps: list[int],
                    requests: list[float], durable_at: list[float]) -> list[float]:
    """Times (s) of the steps :func:`in_flight_indices` names."""
    return [times[i] for i in in_flight_indices(starts, ckpt_steps, requests, durable_at)]


def step_split(times: list[float], starts: list[float], ckpt_steps: list[int],
               requests: list[float], durable_at: list[float], free: list[float],
               own_waits: list[float] | None = None) -> dict:
    """Median step time during a checkpoint and without one, and their ratio.

    ``own_waits`` (s per measured step, optional): the checkpointer's own waits on the
    training thread inside each step (GoCkpt's ``stall_s`` gained during it: window ends,
    gradient copies, slot waits). With it, the split also gives the steps during a checkpoint
    less those waits: what the background work (copy, replay, persist) costs the steps, apart
    from the stall the planner predicts.
    """
    index = in_flight_indices(starts, ckpt_steps, requests, durable_at)
    during = [times[i] for i in index]
    own = [times[i] for i in ckpt_steps]
    free_median = statistics.median(free)
    # The run's noise: how far apart the two halves of the free steps' medians lie.
    half = len(free) // 2
    noise = (abs(statistics.median(free[:half]) - statistics.median(free[half:])) / free_median
             if half >= 2 else float("nan"))
    out = {
        "free_median_s": free_median,
        "free_n": len(free),
        "during_median_s": statistics.median(during) if during else float("nan"),
        "during_n": len(during),
        "during_vs_free": statistics.median(during) / free_median if during else float("nan"),
        "request_step_median_s": statistics.median(own) if own else float("nan"),
        "noise": noise,
    }
    if own_waits is not None and during:
        less = [times[i] - own_waits[i] for i in index]
        out["during_less_own_median_s"] = statistics.median(less)
        out["during_less_own_vs_free"] = statistics.median(less) / free_median
        out["own_wait_during_mean_s"] = statistics.fmean(own_waits[i] for i in index)
    return out


def lone_checkpoint(requests: list[float], durable_at: list[float]) -> int:
    """The checkpoint nearest the middle whose flight overlapped no other's (the middle one if
    all did): its timeline holds its own events only."""
    n = len(durable_at)
    alone = [k for k in range(n)
             if (k + 1 >= len(requests) or durable_at[k] <= requests[k + 1])
             and (k == 0 or durable_at[k - 1] <= requests[k])]
    return min(alone or range(n), key=lambda k: abs(k - n // 2))


def timeline(events: list, start: float, end: float) -> list[dict]:
    """Per (thread, phase), the events that began in ``[start, end)``; offsets from ``start``."""
    rows: dict[tuple[str, str], dict] = {}
    gaps: dict[str, float] = defaultdict(float)
    last_cpu: dict[tuple[str, int], float] = {}
    for e in sorted(events, key=lambda e: e.start):
        if not start <= e.start < end:
            continue
        r = rows.setdefault((e.thread, e.phase), {
            "thread": e.thread, "phase": e.phase, "first_s": e.start - start, "last_s": 0.0,
            "wall_s": 0.0, "cpu_s": 0.0, "count": 0, "bytes": 0})
        r["last_s"] = max(r["last_s"], e.end - start)
        r["wall_s"] += e.end - e.start
        r["cpu_s"] += e.cpu_end - e.cpu_start
        r["count"] += 1
        r["bytes"] += e.nbytes
        key = (e.thread, e.ident)  # a name comes back in the next save's pool: CPU clocks differ
        if key in last_cpu:
            gaps[e.thread] += max(0.0, e.cpu_start - last_cpu[key])
        last_cpu[key] = e.cpu_end
    out = sorted(rows.values(), key=lambda r: (r["thread"], PHASES.index(r["phase"])
                                               if r["phase"] in PHASES else 99))
    for r in out:
        r["between_cpu_s"] = gaps.get(r["thread"], 0.0)
    return out


def phase_slowdown(events: list, times: list[float], starts: list[float],
                   free_median: float) -> dict[str, dict]:
    """For each phase: the steps it kept busy for at least half of their time, and the
    median of their times over the median step without a checkpoint."""
    busy: dict[str, list[float]] = defaultdict(list)
    by_phase: dict[str, list[tuple[float, float]]] = defaultdict(list)
    for e in events:
        by_phase[e.phase].append((e.start, e.end))
    for phase, spans in by_phase.items():
        spans.sort()
        for t, s in zip(times, starts, strict=True):
            covered = _covered(spans, s, s + t)
            if covered >= 0.5 * t:
                busy[phase].append(t)
    return {p: {"steps": len(v), "ratio": statistics.median(v) / free_median}
            for p, v in busy.items()}


def _covered(spans: list[tuple[float, float]], a: float, b: float) -> float:
    """Length of ``[a, b)`` covered by the union of ``spans`` (sorted by start)."""
    total, cursor = 0.0, a
    for s, e in spans:
        if e <= cursor:
            continue
        if s >= b:
            break
        s = max(s, cursor)
        e = min(e, b)
        if e > s:
            total += e - s
            cursor = e
    return total


def format_report(label: str, split: dict, rows: list[dict], slowdown: dict[str, dict],
                  index: int) -> str:
    """Plain-text block for one scheme: the step split, the timeline, the slowdown by phase."""
    during = (f"step during a checkpoint {split['during_median_s']:.3f} s (median of "
              f"{split['during_n']}) vs without {split['free_median_s']:.3f} s (median of "
              f"{split['free_n']}): {split['during_vs_free']:.3f}x"
              if split["during_n"] else
              f"no step started while a checkpoint was in flight; without one "
              f"{split['free_median_s']:.3f} s (median of {split['free_n']})")
    lines = [
        f"{label}: {during}; the request's own step {split['request_step_median_s']:.3f} s; "
        f"noise between halves of the steps without a checkpoint {split['noise']:.3f}",
        f"  timeline of checkpoint {index} (s after the request; cpu = the thread's CPU time in "
        "the phase; between = its CPU time outside any phase, Python holding the GIL):",
        f"  {'thread':<20} {'phase':<9} {'first':>6} {'last':>6} {'busy':>6} {'cpu':>6} "
        f"{'count':>5} {'MB':>7} {'between':>7}",
    ]
    for r in rows:
        lines.append(
            f"  {r['thread']:<20} {r['phase']:<9} {r['first_s']:6.3f} {r['last_s']:6.3f} "
            f"{r['wall_s']:6.3f} {r['cpu_s']:6.3f} {r['count']:5d} {r['bytes'] / 1e6:7.1f} "
            f"{r['between_cpu_s']:7.4f}")
    if slowdown:
        cells = ", ".join(f"{p} {v['ratio']:.2f}x ({v['steps']})" for p, v in
                          sorted(slowdown.items(), key=lambda kv: PHASES.index(kv[0])
                                 if kv[0] in PHASES else 99))
        lines.append(f"  steps >= half covered by a phase, median vs without (n): {cells}")
    return "\n".join(lines)
