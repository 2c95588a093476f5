"""The planner: from state sizes and measured costs to a frozen copy plan. Pure: no I/O, no device.

GoCkpt §4.2: the checkpoint is split into K blocks; block j is copied during the forward/backward
of the (j+1)-th step after the request, while it cannot change; from the second window on, the
gradients of the blocks already copied are copied too (gradients first, §4.2.2), and replayed on
the CPU (§4.3). K = 1 is DataStates-LLM's lazy copy (§V-A2): copy during forward/backward, wait
only before the update.

The stall model (after GoCkpt §4.2.3, counted per window). With ``C = copy_bytes_per_s *
window_s`` the bytes one window can hide, ``s_j`` the state bytes of block j and ``G_j`` the
gradient bytes of blocks ``0..j-1``, window j carries ``s_j + G_j``:

- ``gockpt_o`` (§4.2.4, the gradient copy overlaps the next forward): window j stalls
  ``max(0, s_j + G_j - C) / bw``;
- ``gockpt`` (gradients copied while the training thread waits): ``G_j / bw + max(0, s_j - C) / bw``;
- ``lazy``: one window, ``max(0, S - C) / bw``; ``sync``/``async``: everything, ``S / bw``.

Each window's copy is taken to run ``window_overhead_s`` longer than its bytes at the copy rate
(measured on earlier saves: waking the training thread, chunks that queue behind other work), so
a window hides ``C' = max(0, C - overhead * bw)``: a window its copy fills pays the overhead, one
with room for it pays nothing.

Tensors outside the blocks (buffers, parameters without an optimizer) are copied while the
training thread waits when the non-tensor state is taken, adding ``static_bytes / bw`` to every
mode; that happens as the last window opens, behind its gradient copy, so with static bytes the
last window's gradients are not hidden (it stalls as under ``gockpt``).

The paper's closed form ``T_GoCkpt = N(N-1)/14 T_step`` is the ``gockpt`` line with N equal
blocks that each fill one window (``s_j = C``) and gradients 1/7 of the state. Since later
windows carry more gradients, the planner sizes each block for its window (:func:`make_plan`)
and reports a lower bound no plan can beat (:func:`stall_lower_bound_s`).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

MULTI_STEP_MODES = ("gockpt", "gockpt_o")

#: A plan with more windows is chosen only if it predicts less stall by more than this fraction of
#: one window's copy capacity: every extra window adds a gradient copy and a CPU replay, which
#: the model does not charge.
MIN_GAIN_WINDOWS = 0.01


@dataclass(frozen=True)
class Costs:
    """Measured costs the planner works from.

    Attributes:
        copy_bytes_per_s: host-copy (D2H) bandwidth in bytes/s.
        window_s: seconds from the end of an optimizer update to the start of the next one
            (forward + backward + anything else the loop does): the time a copy can hide in.
        window_overhead_s: seconds each window's copy runs beyond its bytes at
            ``copy_bytes_per_s`` (waking the training thread, chunks queued behind other work),
            measured on earlier saves: a window hides ``window_s - window_overhead_s`` of copy.
    """

    copy_bytes_per_s: float
    window_s: float
    window_overhead_s: float = 0.0


@dataclass(frozen=True)
class CopyPlan:
    """Which units are copied in which window.

    Attributes:
        mode: one of ``sync``, ``async``, ``lazy``, ``gockpt``, ``gockpt_o``.
        blocks: ``blocks[j]`` lists the unit indices copied in window j; ``len(blocks)`` is K.
        predicted_stall_s: the stall model's prediction for this plan, seconds (0.0 when no
            costs were measured yet).
        lower_bound_s: the least stall, in seconds, any plan of at most ``max_overlap_steps``
            windows could have under the same model and costs (:func:`stall_lower_bound_s`);
            0.0 when no costs were measured yet.
        window_overhead_s: the per-window overhead (:attr:`Costs.window_overhead_s`) the
            prediction used, seconds.
        costed: whether the plan was made from measured costs (its prediction means something).
        window_s: the copy window the prediction used, seconds (:attr:`Costs.window_s`).
        paid_s: the part of the prediction no window hides (static tensors, gradients copied
            while the training thread waits), seconds.
        window_loads_s: each window's copy that must fit in it, in seconds at the copy rate:
            ``predicted_stall_s = paid_s + sum(max(0, l - max(0, window_s - window_overhead_s)))``
            over these (empty when not costed).
    """

    mode: str
    blocks: tuple[tuple[int, ...], ...]
    predicted_stall_s: float
    lower_bound_s: float = 0.0
    window_overhead_s: float = 0.0
    costed: bool = False
    window_s: float = 0.0
    paid_s: float = 0.0
    window_loads_s: tuple[float, ...] = ()

    def fit_overhead(self, stall_s: float) -> float | None:
        """The per-window overhead, seconds, under which this plan's model predicts ``stall_s``
        of window stall (a save's measured stall, request and capture left out): the value
        :attr:`Costs.window_overhead_s` is estimated from.

        Where no window stalled, the overhead was at most ``window_s - max(load)``: that bound
        where it is below the plan's own overhead (the fullest window shows the plan asked too
        much), else the plan's overhead (a window with room to spare says nothing new; recording
        nothing there instead would keep only the saves that stalled, and drift upward). A stall
        beyond every window's whole copy gives ``window_s`` (windows hide nothing). None: the
        plan was not costed or copies nothing in its windows. Raises nothing. The model inverted
        is the module's per-window stall model (after GoCkpt §4.2.3), nondecreasing in the
        overhead, so a bisection finds it.
        """
        loads = [x for x in self.window_loads_s if x > 0]
        if not self.costed or not loads:
            return None
        w, top = self.window_s, max(loads)

        def model(oh: float) -> float:
            return _model_stall(self.paid_s, loads, max(0.0, w - oh))

        if stall_s <= model(w - top) + 1e-9:
            return min(w - top, self.window_overhead_s)
        lo, hi = w - top, w
        if model(hi) < stall_s:
            return hi
        for _ in range(60):  # model() is nondecreasing in oh: bisect
            mid = (lo + hi) / 2
            lo, hi = (mid, hi) if model(mid) < stall_s else (lo, mid)
        return hi

    @property
    def num_overlap_steps(self) -> int:
        """K: the number of training steps the copy spans."""
        return len(self.blocks)

    def describe(self, unit_bytes: list[int] | None = None) -> str:
        """One line for logs: mode, K, block sizes in MB (given ``unit_bytes``), predicted stall
        and its lower bound in seconds."""
        sizes = ""
        if unit_bytes is not None:
            sizes = " blocks " + "/".join(
                f"{sum(unit_bytes[i] for i in b) / 1e6:.1f}" for b in self.blocks) + " MB,"
        return (f"{self.mode} K={self.num_overlap_steps},{sizes} predicted stall "
                f"{self.predicted_stall_s:.4f} s (lower bound {self.lower_bound_s:.4f} s)")


def split_blocks(unit_bytes: list[int], k: int) -> tuple[tuple[int, ...], ...]:
    """Split units, in order, into ``k`` contiguous blocks of about equal bytes.

    Keeping order keeps each parameter beside its optimizer state (a unit holds both; GoCkpt
    §4.2.2) and neighbouring layers together. Fewer than ``k`` blocks are returned when there are
    fewer units than ``k``; no units give one empty block. Used where no costs are known (and by
    ranks that must follow an agreed K); :func:`make_plan` sizes blocks per window otherwise.

    Raises:
        ValueError: ``k < 1``.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1, got {k}")
    n = len(unit_bytes)
    if n == 0:
        return ((),)
    k = min(k, n)
    weights = unit_bytes if sum(unit_bytes) > 0 else [1] * n
    total = sum(weights)
    blocks: list[tuple[int, ...]] = []
    cur: list[int] = []
    acc = 0
    for i, w in enumerate(weights):
        open_blocks = k - len(blocks)  # including the current one
        if cur and len(blocks) < k - 1 and (
            n - i <= open_blocks - 1 or acc + w / 2 > total * (len(blocks) + 1) / k
        ):
            blocks.append(tuple(cur))
            cur = []
        cur.append(i)
        acc += w
    blocks.append(tuple(cur))
    return tuple(blocks)


def predict_stall_s(
    mode: str, unit_bytes: list[int], grad_bytes: list[int], blocks: tuple[tuple[int, ...], ...],
    costs: Costs, *, static_bytes: int = 0,
) -> float:
    """Predicted training-thread stall of one checkpoint, in seconds (the module's stall model,
    after GoCkpt §4.2.3 and §4.2.4).

    Args:
        mode: ``sync``, ``async``, ``lazy``, ``gockpt`` or ``gockpt_o``.
        unit_bytes: bytes of state per unit (parameter + optimizer state).
        grad_bytes: bytes of each unit's gradient (0 for a unit that gets none: frozen).
        blocks: the block split, ``blocks[j]`` copied in window j.
        costs: measured costs.
        static_bytes: bytes outside the units, copied while the training thread waits.
    """
    bw = max(costs.copy_bytes_per_s, 1.0)
    paid, loads = _window_terms(mode, unit_bytes, grad_bytes, blocks, static_bytes)
    return _model_stall(paid, loads, _hidden_bytes(costs)) / bw


def _model_stall(paid: float, loads: list[float], hide: float) -> float:
    """The stall model in one line: what is paid anyway plus each window's overflow beyond what
    it hides (any one unit: bytes, or seconds at the copy rate)."""
    return paid + sum(max(0.0, x - hide) for x in loads)


def _hidden_bytes(costs: Costs) -> float:
    """Bytes one window hides: its length less the per-window overhead, at the copy rate."""
    return max(0.0, costs.window_s - max(costs.window_overhead_s, 0.0)) * max(costs.copy_bytes_per_s, 1.0)


def _window_terms(mode: str, unit_bytes: list[int], grad_bytes: list[int],
                  blocks: tuple[tuple[int, ...], ...], static_bytes: int) -> tuple[float, list[float]]:
    """(paid, loads) in bytes: what the training thread waits for whatever the window, and each
    window's copy that hides up to one window's worth (the module's stall model)."""
    if mode in ("sync", "async"):
        return float(sum(unit_bytes) + static_bytes), []
    paid, loads = float(static_bytes), []
    grads_copied = 0  # gradient bytes of the blocks copied before the current window
    for j, block in enumerate(blocks):
        state = sum(unit_bytes[i] for i in block)
        if mode == "gockpt" or (static_bytes and j == len(blocks) - 1):
            # The static copy, taken as the last window opens, queues behind its gradients.
            paid += grads_copied
            loads.append(float(state))
        else:  # gockpt_o, and lazy (one window, no gradients)
            loads.append(float(state + grads_copied))
        grads_copied += sum(grad_bytes[i] for i in block)
    return paid, loads


def stall_lower_bound_s(
    unit_bytes: list[int], grad_bytes: list[int], costs: Costs, *, max_overlap_steps: int,
    static_bytes: int = 0,
) -> float:
    """A lower bound, in seconds, on the predicted stall of every plan of at most
    ``max_overlap_steps`` windows: any mode, any block sizes, any order of the units, blocks even
    cutting through units.

    LP duality on the per-window model: for weights ``l_j = (1-r)^(K-1-j)`` in [0, 1] and any
    line ``G(x) >= r*x + c`` (0 <= r <= 1) under the least cumulative gradient the first ``x``
    state bytes can carry (units sorted by gradient/state ratio),
    ``sum_j max(0, load_j - C) >= sum_j l_j (load_j - C) >= S + c (L - l_0) - C L`` with
    ``L = sum_j l_j``. For a constant ratio r <= 1 this is ``S - C (1 - (1-r)^K) / r``: the
    stall of filling each window up to C and leaving the rest to the last, which is optimal.

    Args:
        unit_bytes: bytes of state per unit.
        grad_bytes: gradient bytes per unit.
        costs: measured costs.
        max_overlap_steps: the most windows a plan may use (>= 1).
        static_bytes: bytes outside the units, copied while the training thread waits.

    Raises:
        ValueError: ``max_overlap_steps < 1`` or the lists differ in length.
    """
    if max_overlap_steps < 1:
        raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
    if len(unit_bytes) != len(grad_bytes):
        raise ValueError("unit_bytes and grad_bytes differ in length")
    bw = max(costs.copy_bytes_per_s, 1.0)
    cap = _hidden_bytes(costs)
    total = float(sum(unit_bytes))
    lines = _support_lines(unit_bytes, grad_bytes)
    best = total  # every bound is at most the total, in one window
    for k in range(1, max_overlap_steps + 1):
        bound_k = 0.0
        for r, c in lines:
            first = (1.0 - r) ** (k - 1)  # l_0
            big_l = (1.0 - first * (1.0 - r)) / r if r > 0 else float(k)
            bound_k = max(bound_k, total + c * (big_l - first) - cap * big_l)
        best = min(best, max(0.0, bound_k))
    return (best + static_bytes) / bw


def _support_lines(unit_bytes: list[int], grad_bytes: list[int]) -> list[tuple[float, float]]:
    """Lines ``r*x + c`` (0 <= r <= 1) below the least gradient bytes any prefix of ``x`` state
    bytes carries: the convex piecewise-linear curve of the units sorted by gradient/state ratio
    (units of no state are left out: placed last, they carry nothing)."""
    pieces = sorted((g / s, s) for s, g in zip(unit_bytes, grad_bytes, strict=True) if s > 0)
    lines = [(0.0, 0.0)]  # G(x) >= 0
    x, y, left = 0.0, 0.0, 0.0
    for ratio, s in pieces:
        r = min(ratio, 1.0)
        if r >= left:  # a subgradient at (x, y): the line supports the curve
            lines.append((r, y - r * x))
        x, y, left = x + s, y + ratio * s, ratio
    return lines


def _window_dp(unit_bytes: list[int], grad_bytes: list[int], cap: float, k_max: int,
               overlap: bool, overlap_last: bool) -> list[tuple[float, tuple[tuple[int, ...], ...]] | None]:
    """The least stall bytes (static excluded) and its contiguous split, for each K = 1..k_max
    windows exactly (``None`` where there are fewer units than K).

    Window ``[a, b)`` costs ``P[a] + max(0, S[b] - C - H[a])`` (prefix sums S of state, G of
    gradients; ``overlap``: P = 0, H = S - G; else P = G, H = S). Where H is nondecreasing (a
    unit's gradient never exceeds its state, as the engine's never do) the least cost over the
    start ``a`` splits at the first ``a*`` with ``H[a*] >= S[b] - C``: a running minimum of
    ``f(a) - H[a]`` before it and a sliding-window minimum of ``f(a) + P[a]`` after it, both
    moving right with ``b``, so each K costs O(n); otherwise O(n^2). The last window ``[a, n)``
    costs ``G[a] + max(0, S[n] - S[a] - C)`` unless ``overlap_last`` (its gradients hidden too).
    """
    n = len(unit_bytes)
    s_pre, g_pre = [0] * (n + 1), [0] * (n + 1)
    for i in range(n):
        s_pre[i + 1] = s_pre[i] + unit_bytes[i]
        g_pre[i + 1] = g_pre[i] + grad_bytes[i]
    if overlap:
        pay, h = [0] * (n + 1), [s - g for s, g in zip(s_pre, g_pre, strict=True)]
    else:
        pay, h = g_pre, s_pre
    monotone = all(h[i] <= h[i + 1] for i in range(n))
    inf = float("inf")
    f = [0.0] + [inf] * n  # f[b]: least cost of units [0, b) in j windows (j = 0 here)
    choice: list[list[int]] = []
    results: list[tuple[float, tuple[tuple[int, ...], ...]] | None] = []
    for j in range(k_max):
        # Exactly j + 1 windows: the least f[a] (j windows over [0, a)) plus the last window.
        last, last_a = inf, -1
        for a in range(n):
            if overlap and overlap_last:
                v = f[a] + max(0.0, s_pre[n] - h[a] - cap)
            else:
                v = f[a] + g_pre[a] + max(0.0, s_pre[n] - s_pre[a] - cap)
            if v < last:
                last, last_a = v, a
        if last == inf:
            results.append(None)
        else:
            cuts, b = [tuple(range(last_a, n))], last_a
            for arg_j in reversed(choice):
                a = arg_j[b]
                cuts.append(tuple(range(a, b)))
                b = a
            results.append((max(0.0, last), tuple(reversed(cuts))))
        if j == k_max - 1:
            break
        fp = [f[a] + pay[a] for a in range(n + 1)]
        g_new, arg = [inf] * (n + 1), [-1] * (n + 1)
        if monotone:
            pm, pm_arg = [inf] * (n + 2), [-1] * (n + 2)  # pm[m]: min over a < m of fp - h
            for a in range(n + 1):
                v = fp[a] - h[a]
                pm[a + 1], pm_arg[a + 1] = (v, a) if v < pm[a] else (pm[a], pm_arg[a])
            star = 0  # a*: the first start whose window hides nothing more
            window: deque[int] = deque()  # starts in [a*, b), by increasing fp
            for b in range(1, n + 1):
                t = s_pre[b] - cap
                while star <= n and h[star] < t:
                    star += 1
                a = b - 1
                while window and fp[window[-1]] >= fp[a]:
                    window.pop()
                window.append(a)
                while window and window[0] < star:
                    window.popleft()
                m = min(star, b)
                if pm[m] + t < g_new[b]:
                    g_new[b], arg[b] = pm[m] + t, pm_arg[m]
                if window and fp[window[0]] < g_new[b]:
                    g_new[b], arg[b] = fp[window[0]], window[0]
        else:
            for b in range(1, n + 1):
                for a in range(b):
                    v = fp[a] + max(0.0, s_pre[b] - cap - h[a])
                    if v < g_new[b]:
                        g_new[b], arg[b] = v, a
        f = g_new
        choice.append(arg)
    return results


def make_plan(
    mode: str,
    unit_bytes: list[int],
    grad_bytes: list[int],
    costs: Costs | None,
    *,
    max_overlap_steps: int,
    replayable: bool,
    min_overlap_steps: int = 1,
    static_bytes: int = 0,
) -> CopyPlan:
    """Choose the mode, K and the block of each window for one checkpoint.

    With measured costs the multi-step modes size each block for its window (window j also
    carries the gradients of blocks ``0..j-1``), exactly under the module's stall model over
    contiguous splits, and take the K in ``[min_overlap_steps, max_overlap_steps]`` of least
    predicted stall: K grows only while a window more lowers it by more than
    :data:`MIN_GAIN_WINDOWS` of a window (GoCkpt §4.2.3 caps K near 7 for the same reason:
    gradient traffic grows with K). ``auto`` takes the least predicted stall of ``lazy`` and
    ``gockpt_o`` (whose model never predicts more than ``gockpt``'s), ``lazy`` on ties, so it
    never predicts more stall than ``lazy``; without measured costs it picks ``lazy``. Without costs the multi-step modes split
    into ``max_overlap_steps`` blocks of equal bytes. Modes that need replay fall back to
    ``lazy`` when ``replayable`` is False (the caller warns).

    Args:
        mode: ``auto``, ``sync``, ``async``, ``lazy``, ``gockpt`` or ``gockpt_o``.
        unit_bytes: bytes of state per unit, in copy order.
        grad_bytes: gradient bytes per unit (0 for units without a gradient: frozen).
        costs: measured costs, or None before anything was measured.
        max_overlap_steps: upper bound on K (>= 1).
        min_overlap_steps: lower bound on K for the multi-step modes.
        replayable: whether every optimizer can be replayed on the CPU.
        static_bytes: bytes outside the units (buffers, parameters without an optimizer),
            copied while the training thread waits when the non-tensor state is taken.

    Returns:
        The plan, with its predicted stall and the lower bound over plans of at most
        ``max_overlap_steps`` windows (:func:`stall_lower_bound_s`).

    Raises:
        ValueError: unknown mode, ``max_overlap_steps < 1``, or the lists differ in length.
    """
    if max_overlap_steps < 1:
        raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
    if len(unit_bytes) != len(grad_bytes):
        raise ValueError("unit_bytes and grad_bytes differ in length")
    if mode not in ("auto", "sync", "async", "lazy", *MULTI_STEP_MODES):
        raise ValueError(f"unknown mode {mode!r}")
    if mode in MULTI_STEP_MODES and not replayable:
        mode = "lazy"
    if costs is None:
        if mode in MULTI_STEP_MODES:
            return CopyPlan(mode, split_blocks(unit_bytes, max_overlap_steps), 0.0)
        return CopyPlan("lazy" if mode == "auto" else mode, split_blocks(unit_bytes, 1), 0.0)
    bound = stall_lower_bound_s(unit_bytes, grad_bytes, costs, max_overlap_steps=max_overlap_steps,
                                static_bytes=static_bytes)
    if mode == "auto" and not replayable:
        mode = "lazy"

    def costed(m: str, blocks: tuple[tuple[int, ...], ...], stall_s: float | None = None) -> CopyPlan:
        paid, loads = _window_terms(m, unit_bytes, grad_bytes, blocks, static_bytes)
        if stall_s is None:
            stall_s = _model_stall(paid, loads, _hidden_bytes(costs)) / bw
        return CopyPlan(m, blocks, stall_s, bound, max(costs.window_overhead_s, 0.0), costed=True,
                        window_s=costs.window_s, paid_s=paid / bw,
                        window_loads_s=tuple(x / bw for x in loads))

    bw = max(costs.copy_bytes_per_s, 1.0)
    if mode in ("sync", "async", "lazy"):
        return costed(mode, split_blocks(unit_bytes, 1))
    # (stall bytes, K, preference, mode, blocks); auto's K = 1 is lazy, preferred on ties.
    # auto: gockpt_o's window never predicts more than gockpt's (max(0, s+G-C) <= G + max(0, s-C)).
    modes = ("gockpt_o",) if mode == "auto" else (mode,)
    k_lo = min(min_overlap_steps, max_overlap_steps)
    hide = _hidden_bytes(costs)  # what one window hides, its overhead taken off
    candidates: list[tuple[float, int, int, str, tuple[tuple[int, ...], ...]]] = []
    for rank, m in enumerate(modes):
        found = _window_dp(unit_bytes, grad_bytes, hide, max_overlap_steps, m == "gockpt_o",
                           overlap_last=not static_bytes)
        for k, best in enumerate(found, start=1):
            if best is None:
                continue
            if k >= k_lo:
                candidates.append((best[0], k, rank + 1, m, best[1]))
            elif k == 1 and mode == "auto":
                candidates.append((best[0], 1, 0, "lazy", best[1]))
    if not candidates:  # no units, or fewer than min_overlap_steps: at most one block each
        m = "lazy" if mode == "auto" else mode
        return costed(m, split_blocks(unit_bytes, 1 if m == "lazy" else max_overlap_steps))
    least = min(c[0] for c in candidates)
    stall_bytes, k, _, m, blocks = min(
        (c for c in candidates if c[0] <= least + MIN_GAIN_WINDOWS * max(costs.window_s, 0.0) * bw),
        key=lambda c: (c[1], c[2]))
    if k == 1 and mode == "auto":
        m = "lazy"
    return costed(m, blocks, (stall_bytes + static_bytes) / bw)
