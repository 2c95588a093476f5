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

Each window's copy is taken to run an overhead ``o`` longer than its bytes at the copy rate
(waking the copy thread, chunks that queue behind other work, a window shorter than the forecast),
so a window hides ``C' = max(0, C - o * bw)``: a window its copy fills pays the overhead, one with
room for it pays nothing. The overhead varies from window to window (a second core shared with
replay and persist), so the prediction is the mean of the model over the overheads measured on
the latest windows (:attr:`Costs.overhead_samples_s`), and plans are chosen by that mean: a plan
that fills every window to the median capacity stalls in every window that runs slow.

Tensors outside the blocks (buffers, parameters without an optimizer) are copied while the
training thread waits when the non-tensor state is taken, adding ``static_bytes / bw`` to every
mode; that happens as the last window opens, behind its gradient copy, so with static bytes the
last window's gradients are not hidden (it stalls as under ``gockpt``).

The CPU replay (§4.3) of each update's gradients must keep up with the steps: the gradients go
to two host buffers in turn, so a capture waits for the replay of the one two updates before.
Where the replay rate has been measured (:attr:`Costs.replay_bytes_per_s`) those waits are
predicted too (:func:`replay_wait_s`) and enter the choice of K: on a GPU whose steps take
milliseconds, a CPU replay of hundreds of MB per update cannot keep up beyond a few windows.

The paper's closed form ``T_GoCkpt = N(N-1)/14 T_step`` is the ``gockpt`` line with N equal
blocks that each fill one window (``s_j = C``) and gradients 1/7 of the state. Since later
windows carry more gradients, the planner sizes each block for its window (:func:`make_plan`)
and reports a lower bound no plan can beat (:func:`stall_lower_bound_s`).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import numpy as np

MULTI_STEP_MODES = ("gockpt", "gockpt_o")

#: A plan with more windows is chosen only if it predicts less stall by more than this fraction of
#: one window's copy capacity: every extra window adds a gradient copy and a CPU replay, which
#: the model does not charge.
MIN_GAIN_WINDOWS = 0.01

#: Steps the persist of a save is given, between its last copy window and the next request, to
#: write out the bytes that request's first window copies into the same host slot. A plan whose
#: windows end within this many steps of the next request (``interval - margin < K <= interval``)
#: makes that request wait for the slot (measured: LoRA on the emulated link, a checkpoint every
#: 6 steps, K = 6 stalled 0.144 s per save, K = 5 0.024 s).
DRAIN_MARGIN_STEPS = 1


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
            Used where ``overhead_samples_s`` is empty.
        overhead_samples_s: the same overhead as measured on each of the latest windows,
            seconds (negative: the copy ran faster than ``copy_bytes_per_s``, or the window was
            longer than ``window_s``). With them the model predicts the mean stall over the
            samples, each window hiding ``window_s - o`` for a sample ``o``: a window its copy
            nearly fills stalls in the share of windows that ran slow.
        replay_bytes_per_s: how fast the CPU replay brings state forward, in bytes of state
            (parameter and optimizer state of the units replayed) per second, as measured on
            earlier saves; 0.0 when unknown: the model then charges no wait for a gradient
            buffer (:func:`replay_wait_s`).
        step_s: seconds between two optimizer updates (the window and the update); 0.0 when
            unknown: ``window_s`` stands in.
        replay_backlog_s: seconds of replay already queued at the request (earlier saves'
            updates, with several host slots), before which this save's first replay cannot
            start.
    """

    copy_bytes_per_s: float
    window_s: float
    window_overhead_s: float = 0.0
    overhead_samples_s: tuple[float, ...] = ()
    replay_bytes_per_s: float = 0.0
    step_s: float = 0.0
    replay_backlog_s: float = 0.0


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
        window_overhead_s: the per-window overhead (:attr:`Costs.window_overhead_s`, the median
            of the samples where there are any) the costs gave, seconds.
        copy_bytes_per_s: the copy rate (bytes/s) the prediction used (0.0 when not costed).
        costed: whether the plan was made from measured costs (its prediction means something).
        window_s: the copy window the prediction used, seconds (:attr:`Costs.window_s`).
        paid_s: the part of the prediction no window hides (static tensors, gradients copied
            while the training thread waits), seconds.
        window_loads_s: each window's copy that must fit in it, in seconds at the copy rate:
            ``predicted_stall_s`` is ``paid_s + sum(max(0, l - max(0, window_s - o)))`` over
            these, averaged over the overhead samples ``o`` (empty when not costed), plus
            ``replay_wait_s``.
        replay_wait_s: the part of the prediction spent waiting for a gradient buffer that the
            CPU replay has not released yet, seconds (:func:`replay_wait_s`).
        flushed_at: None, or the number of windows that run before the next checkpoint request
            is expected (K > the request interval): the blocks of the later windows are copied
            at that request, with the training thread waiting (counted in ``paid_s``), and that
            request shares this snapshot (:func:`make_plan`).
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
    flushed_at: int | None = None
    copy_bytes_per_s: float = 0.0
    replay_wait_s: float = 0.0

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
        flushed = "" if self.flushed_at is None else f" (next request after {self.flushed_at})"
        return (f"{self.mode} K={self.num_overlap_steps}{flushed},{sizes} predicted stall "
                f"{self.predicted_stall_s:.4f} s (lower bound {self.lower_bound_s:.4f} s)")


def split_blocks(unit_bytes: list[int], k: int) -> tuple[tuple[int, ...], ...]:
    """Split units, in order, into ``k`` contiguous blocks of about equal bytes.

    Keeping order keeps each parameter beside its optimizer state (a unit holds both; GoCkpt
    §4.2.2) and neighbouring layers together. Fewer than ``k`` blocks are returned when there are
    fewer units than ``k``; no units give one empty block. Used where no costs are known;
    :func:`make_plan` sizes blocks per window otherwise.

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
    after GoCkpt §4.2.3 and §4.2.4, with the waits for gradient buffers of
    :func:`replay_wait_s`).

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
    return (_model_stall(paid, loads, _hides(costs)) / bw
            + replay_wait_s(mode, unit_bytes, grad_bytes, blocks, costs))


def replay_wait_s(
    mode: str, unit_bytes: list[int], grad_bytes: list[int], blocks: tuple[tuple[int, ...], ...],
    costs: Costs, *, captures: int | None = None,
    prefix: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> float:
    """Predicted seconds the training thread waits for a gradient buffer the CPU replay still
    holds, in one multi-step checkpoint (0.0 for other modes, or when ``costs`` has no replay
    rate).

    An extension of GoCkpt §4.2.3, which takes the replay (§4.3) to keep up with the steps:
    on a GPU whose steps take milliseconds it need not. The gradients of the update ending
    window ``c`` (blocks ``0..c``, ``c < K - 1``) go to gradient buffer ``c % 2``; capture
    ``c`` therefore waits until the replay of capture ``c - 2`` is done. With ``P`` the step
    period (:attr:`Costs.step_s`), capture ``c`` comes at ``(c + 1) P`` plus the waits before
    it, its gradients arrive ``G_c / bw`` later, and the replays run one after another, each
    ``R_c / replay_bytes_per_s`` long, ``R_c`` the state bytes of the units of blocks ``0..c``
    that have a gradient, the first no earlier than :attr:`Costs.replay_backlog_s` (replays
    queued before the request). A window whose copy the stall model says overflows it (its
    load beyond what one window hides, the mean over the overhead samples) ends that much
    later, and so do the captures after it: the update waits for the copy (on the host on a
    CPU, on the device on a GPU, where the steps then run longer). Left out, those delays made
    an H200's predicted waits several times the measured ones (steps of 6.4 ms ran 11-12 ms
    during a save).

    Args:
        mode: the plan's mode; only ``gockpt`` and ``gockpt_o`` replay.
        unit_bytes: state bytes per unit.
        grad_bytes: gradient bytes per unit (0: frozen, not replayed).
        blocks: the plan's blocks.
        costs: measured costs (:attr:`Costs.replay_bytes_per_s`, :attr:`Costs.step_s`).
        captures: the number of gradient captures when the windows are cut short by the next
            request (:attr:`CopyPlan.flushed_at`); None: ``K - 1``.
        prefix: prefix sums of state, gradient and replayed state bytes over the units, for
            blocks that are sorted contiguous ranges (:func:`make_plan`'s); None: summed.

    Raises nothing; a block index outside the lists raises ``IndexError``.
    """
    rate = costs.replay_bytes_per_s
    n_cap = len(blocks) - 1 if captures is None else min(captures, len(blocks) - 1)
    if mode not in MULTI_STEP_MODES or rate <= 0 or n_cap < 3:
        return 0.0  # two buffers: the first two captures never wait
    bw = max(costs.copy_bytes_per_s, 1.0)
    period = costs.step_s if costs.step_s > 0 else costs.window_s
    _, loads = _window_terms(mode, unit_bytes, grad_bytes, blocks[:n_cap], 0, prefix)
    hides = _hides(costs)
    late = [float(np.maximum(load - hides, 0.0).mean()) / bw for load in loads]
    grads = replayed = 0
    shift = waited = 0.0
    finish: list[float] = []
    for c in range(n_cap):
        _, block_grads, block_replayed = _block_sums(blocks[c], unit_bytes, grad_bytes, prefix)
        grads += block_grads
        replayed += block_replayed
        shift += late[c]  # window c ended that late: its capture and every later one too
        t = (c + 1) * period + shift
        if c >= 2 and finish[c - 2] > t:
            wait = finish[c - 2] - t
            waited, shift, t = waited + wait, shift + wait, t + wait
        start = max(t + grads / bw, finish[-1] if finish else costs.replay_backlog_s)
        finish.append(start + replayed / rate)
    return waited


def _model_stall(paid: float, loads: list[float], hides: np.ndarray | float) -> float:
    """The stall model: what is paid anyway plus each window's overflow beyond what it hides,
    the mean over ``hides`` (what one window hides, one value per overhead sample; any one unit:
    bytes, or seconds at the copy rate)."""
    if not loads:
        return paid
    over = np.asarray(loads, dtype=np.float64)[:, None] - np.atleast_1d(hides)[None, :]
    return paid + float(np.maximum(over, 0.0).sum(axis=0).mean())


def _lazy_is_free(unit_bytes: list[int], hides: np.ndarray) -> bool:
    """Whether one window hides all of ``unit_bytes`` (bytes) under every value of ``hides``
    (bytes one window hides, per overhead sample): ``lazy`` then waits for no window."""
    return bool(sum(unit_bytes) <= float(np.min(hides)))


def _overheads(costs: Costs) -> np.ndarray:
    """The per-window overheads of ``costs``, seconds: its samples, else its one value."""
    return np.asarray(costs.overhead_samples_s or (costs.window_overhead_s,), dtype=np.float64)


def _hides(costs: Costs) -> np.ndarray:
    """Bytes one window hides under each overhead sample: its length less the overhead, at the
    copy rate."""
    return np.maximum(0.0, costs.window_s - _overheads(costs)) * max(costs.copy_bytes_per_s, 1.0)


def _window_terms(mode: str, unit_bytes: list[int], grad_bytes: list[int],
                  blocks: tuple[tuple[int, ...], ...], static_bytes: int,
                  prefix: tuple[np.ndarray, ...] | None = None) -> tuple[float, list[float]]:
    """(paid, loads) in bytes: what the training thread waits for whatever the window, and each
    window's copy that hides up to one window's worth (the module's stall model). ``prefix``:
    the prefix sums of :func:`_prefix_sums`, for callers
    that score many splits of the same units into contiguous ranges of ascending indices (a
    block then costs O(1)); without it any blocks are summed unit by unit."""
    if mode in ("sync", "async"):
        return float(sum(unit_bytes) + static_bytes), []
    paid, loads = float(static_bytes), []
    grads_copied = 0  # gradient bytes of the blocks copied before the current window
    for j, block in enumerate(blocks):
        state, grads, _ = _block_sums(block, unit_bytes, grad_bytes, prefix)
        if mode == "gockpt" or (static_bytes and j == len(blocks) - 1):
            # The static copy, taken as the last window opens, queues behind its gradients.
            paid += grads_copied
            loads.append(float(state))
        else:  # gockpt_o, and lazy (one window, no gradients)
            loads.append(float(state + grads_copied))
        grads_copied += grads
    return paid, loads


def _block_sums(block: tuple[int, ...], unit_bytes: list[int], grad_bytes: list[int],
                prefix: tuple[np.ndarray, ...] | None) -> tuple[int, int, int]:
    """(state, gradient, replayed state) bytes of ``block``: from ``prefix`` (:func:`_prefix_sums`)
    where given, for the planner's blocks (sorted, contiguous ranges: O(1)), else summed."""
    if prefix is not None and block:
        a, b = block[0], block[-1] + 1
        return tuple(int(pre[b] - pre[a]) for pre in prefix)  # type: ignore[return-value]
    return (sum(unit_bytes[i] for i in block), sum(grad_bytes[i] for i in block),
            sum(unit_bytes[i] for i in block if grad_bytes[i]))


def _prefix_sums(unit_bytes: list[int], grad_bytes: list[int],
                 ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Prefix sums (int64, one longer than the lists) of the state bytes, the gradient bytes
    and the state bytes of the units that have a gradient (what the replay updates)."""
    units = np.asarray(unit_bytes, dtype=np.int64)
    grads = np.asarray(grad_bytes, dtype=np.int64)
    out = np.zeros((3, len(unit_bytes) + 1), dtype=np.int64)
    np.cumsum(units, out=out[0, 1:])
    np.cumsum(grads, out=out[1, 1:])
    np.cumsum(np.where(grads > 0, units, 0), out=out[2, 1:])
    return out[0], out[1], out[2]


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

    With overhead samples the prediction is a mean over them; each window's overflow is convex
    in the overhead ``o`` clipped at ``window_s`` (where a window hides nothing), so by Jensen's
    inequality the bound at the mean clipped overhead bounds that mean too.

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
    cap = max(0.0, costs.window_s - float(np.minimum(_overheads(costs), costs.window_s).mean())) * bw
    total = float(sum(unit_bytes))
    r, c = _support_lines(unit_bytes, grad_bytes)
    q = 1.0 - r
    safe_r = np.where(r > 0, r, 1.0)
    best = total  # every bound is at most the total, in one window
    for k in range(1, max_overlap_steps + 1):
        first = np.power(q, k - 1)  # l_0
        big_l = np.where(r > 0, (1.0 - first * q) / safe_r, float(k))
        bound_k = float(np.max(total + c * (big_l - first) - cap * big_l))
        best = min(best, max(0.0, bound_k))
    return (best + static_bytes) / bw


def _support_lines(unit_bytes: list[int], grad_bytes: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """Lines ``r*x + c`` (0 <= r <= 1), as arrays ``(r, c)``, below the least gradient bytes any
    prefix of ``x`` state bytes carries: the convex piecewise-linear curve of the units sorted by
    gradient/state ratio (units of no state are left out: placed last, they carry nothing)."""
    s = np.asarray(unit_bytes, dtype=np.int64)
    g = np.asarray(grad_bytes, dtype=np.int64)
    keep = s > 0
    s, g = s[keep].astype(np.float64), g[keep].astype(np.float64)
    ratio = g / s
    order = np.lexsort((s, ratio))  # by ratio, then by state bytes
    ratio, s = ratio[order], s[order]
    x = np.concatenate(([0.0], np.cumsum(s)[:-1]))  # state bytes before each piece
    y = np.concatenate(([0.0], np.cumsum(ratio * s)[:-1]))  # their gradient bytes
    left = np.concatenate(([0.0], ratio[:-1]))
    r = np.minimum(ratio, 1.0)
    sup = r >= left  # a subgradient at (x, y): the line supports the curve
    return (np.concatenate(([0.0], r[sup])),  # G(x) >= 0 first
            np.concatenate(([0.0], y[sup] - r[sup] * x[sup])))


def _window_dp(unit_bytes: list[int], grad_bytes: list[int], cap: float, k_max: int,
               overlap: bool, overlap_last: bool) -> list[tuple[float, tuple[tuple[int, ...], ...]] | None]:
    """The least stall bytes (static excluded) and its contiguous split, for each K = 1..k_max
    windows exactly (``None`` where there are fewer units than K).

    Window ``[a, b)`` costs ``P[a] + max(0, S[b] - C - H[a])`` (prefix sums S of state, G of
    gradients; ``overlap``: P = 0, H = S - G; else P = G, H = S). Where H is nondecreasing (a
    unit's gradient never exceeds its state, as the engine's never do) the least cost over the
    start ``a`` splits at the first ``a*`` with ``H[a*] >= S[b] - C``: a prefix minimum of
    ``f(a) - H[a]`` before it and a range minimum of ``f(a) + P[a]`` over ``[a*, b)`` after it,
    each taken for every ``b`` at once (numpy; a sparse table for the range minimum), so each K
    costs O(n log n) in a few dozen array operations rather than a Python loop per unit (this
    runs on the training thread at every request); otherwise O(n^2) per K. The last window
    ``[a, n)`` costs ``G[a] + max(0, S[n] - S[a] - C)`` unless ``overlap_last`` (its gradients
    hidden too). Ties go to the earliest last window and, inside, as the prefix minimum (earliest
    start) before the range minimum (latest start).
    """
    n = len(unit_bytes)
    if n == 0:
        return [None] * k_max
    s_pre = np.zeros(n + 1, dtype=np.int64)
    g_pre = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(np.asarray(unit_bytes, dtype=np.int64), out=s_pre[1:])
    np.cumsum(np.asarray(grad_bytes, dtype=np.int64), out=g_pre[1:])
    if overlap:
        pay, h = np.zeros(n + 1, dtype=np.int64), s_pre - g_pre
    else:
        pay, h = g_pre, s_pre
    monotone = bool(np.all(h[:-1] <= h[1:]))
    inf = float("inf")
    idx = np.arange(n + 1)
    b_all = idx[1:]
    t = s_pre[1:] - cap  # t[b - 1]: what a window ending at b copies beyond C, less H[a]
    # The last window [a, n), for every a < n.
    if overlap and overlap_last:
        last_pay, last_over = 0, np.maximum(0.0, s_pre[n] - h[:n] - cap)
    else:
        last_pay, last_over = g_pre[:n], np.maximum(0.0, s_pre[n] - s_pre[:n] - cap)
    if monotone:
        star = np.minimum(np.searchsorted(h, t, side="left"), b_all)
        some = star <= b_all - 1  # windows ending at b that some start in [a*, b) hides
        hidden_b = b_all[some]
        range_min = _RangeMin(n, star[some], hidden_b - 1)
    f = np.full(n + 1, inf)
    f[0] = 0.0  # f[b]: least cost of units [0, b) in j windows (j = 0 here)
    choice: list[np.ndarray] = []
    results: list[tuple[float, tuple[tuple[int, ...], ...]] | None] = []
    for j in range(k_max):
        # Exactly j + 1 windows: the least f[a] (j windows over [0, a)) plus the last window.
        v = (f[:n] + last_pay) + last_over
        last_a = int(np.argmin(v))
        if v[last_a] == inf:
            results.append(None)
        else:
            cuts, b = [tuple(range(last_a, n))], last_a
            for arg_j in reversed(choice):
                a = int(arg_j[b])
                cuts.append(tuple(range(a, b)))
                b = a
            results.append((max(0.0, float(v[last_a])), tuple(reversed(cuts))))
        if j == k_max - 1:
            break
        fp = f + pay
        g_new, arg = np.full(n + 1, inf), np.full(n + 1, -1, dtype=np.int64)
        if monotone:
            # Starts a < a*: the window copies beyond C, cost fp[a] - H[a] + t (prefix minimum).
            vals = fp - h
            pm = np.empty(n + 2)
            pm[0] = inf
            np.minimum.accumulate(vals, out=pm[1:])
            new = vals < pm[:-1]  # a strictly lower prefix minimum starts at a
            pm_arg = np.empty(n + 2, dtype=np.int64)
            pm_arg[0] = -1
            pm_arg[1:] = np.maximum.accumulate(np.where(new, idx, -1))
            g_new[1:] = pm[star] + t  # inf, with pm_arg -1, where no start before a* exists
            arg[1:] = pm_arg[star]
            # Starts in [a*, b): the window hides its copy, cost fp[a] (range minimum).
            if len(hidden_b):
                rv, ri = range_min(fp[:n])
                better = rv < g_new[hidden_b]
                g_new[hidden_b[better]] = rv[better]
                arg[hidden_b[better]] = ri[better]
        else:
            for b in range(1, n + 1):
                v_b = fp[:b] + np.maximum(0.0, s_pre[b] - cap - h[:b])
                a = int(np.argmin(v_b))
                if v_b[a] < inf:
                    g_new[b], arg[b] = v_b[a], a
        f = g_new
        choice.append(arg)
    return results


class _RangeMin:
    """Least value and its latest index over fixed ranges ``[lo[i], hi[i]]`` (``lo <= hi``) of
    arrays of one length, by a sparse table (row ``k``: the least over ``[a, a + 2**k)``): the
    ranges are laid out once, each array then costs a few array operations per row."""

    def __init__(self, n: int, lo: np.ndarray, hi: np.ndarray) -> None:
        span = hi - lo + 1
        self.level = np.frexp(span.astype(np.float64))[1] - 1  # floor(log2(span)), exact
        self.rows = int(self.level.max()) + 1 if len(span) else 1
        self.lo, self.b = lo, hi - (np.int64(1) << self.level) + 1
        self.n = n

    def __call__(self, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        n = self.n
        vals = np.empty((self.rows, n))
        where = np.empty((self.rows, n), dtype=np.int64)
        vals[0], where[0] = x, np.arange(n)
        width = 1
        for k in range(1, self.rows):
            m = n - width  # row k is read only where a + 2**k <= n
            left, right = vals[k - 1, :m], vals[k - 1, width:]
            take_right = right <= left
            vals[k, :m] = np.where(take_right, right, left)
            where[k, :m] = np.where(take_right, where[k - 1, width:], where[k - 1, :m])
            width *= 2
        va, vb = vals[self.level, self.lo], vals[self.level, self.b]
        take_b = vb <= va
        return np.where(take_b, vb, va), np.where(take_b, where[self.level, self.b],
                                                  where[self.level, self.lo])


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
    interval_steps: int | None = None,
    next_request_shares: bool = True,
    grad_overlap: bool = True,
) -> CopyPlan:
    """Choose the mode, K and the block of each window for one checkpoint.

    With measured costs the multi-step modes size each block for its window (window j also
    carries the gradients of blocks ``0..j-1``): the least stall under the module's stall model
    over contiguous splits for a window of the median overhead, and, where the overhead
    samples' spread raises that least stall by more than the gain below, also for a slow
    window (the 90th percentile of the samples). Every such split is scored by the mean
    predicted stall over the samples (the best split for that mean is not searched for
    exhaustively), and the K taken is the one in ``[min_overlap_steps, max_overlap_steps]`` of
    least predicted stall: K grows only while a window more lowers it by more than
    :data:`MIN_GAIN_WINDOWS` of a window (GoCkpt §4.2.3 caps K near 7 for the same reason:
    gradient traffic grows with K). ``auto`` takes the least predicted stall of ``lazy`` and
    ``gockpt_o`` (whose model never predicts more than ``gockpt``'s), ``lazy`` on ties, so it
    never predicts more stall than ``lazy``; without measured costs it picks ``lazy``. Without
    costs the multi-step modes split into ``max_overlap_steps`` blocks of equal bytes. Modes
    that need replay fall back to ``lazy`` when ``replayable`` is False (the caller warns).

    With ``interval_steps`` (the steps until the next checkpoint request, as the caller
    expects them from earlier requests) K is chosen with that request in view (an extension of
    the paper's model, which assumes the copy ends before the next request):

    - ``K <= interval - DRAIN_MARGIN_STEPS``: the plan as above.
    - ``interval - DRAIN_MARGIN_STEPS < K <= interval``: left out where a K of the first kind
      exists. The windows end right before the next request, which then waits for this save's
      persist to write out the host slot its first window reuses, a wait the model does not
      count. (Where none exists, e.g. a request every step, they compete on their own stall.)
    - ``K > interval``: the next request finds windows still open. It copies their blocks at
      once (plus the gradients of the last update of the blocks already copied), while the
      training thread waits, and shares the snapshot, copying nothing of its own. The plan's
      prediction counts that copy (:attr:`CopyPlan.flushed_at`). Such a plan is chosen only
      where its own stall is the least: the two checkpoints then hold the same step, so it is
      not counted as a saving that halves the copy. Without ``next_request_shares`` the next
      request needs a slot of its own (it waits for it, or skips), and these K are left out as
      the ones above.

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
        interval_steps: optimizer steps from this request to the next one (>= 1), or None
            when unknown.
        next_request_shares: whether a request that cuts this plan's windows short takes its
            snapshot (False where ranks must agree on K: :mod:`gockpt.sharded`).
        grad_overlap: whether ``auto`` may overlap the gradient copy with the next forward
            (``gockpt_o``); False once the loop was seen writing gradients in place before
            the next backward (``gockpt`` then).

    Returns:
        The plan, with its predicted stall and the lower bound over plans of at most
        ``max_overlap_steps`` windows (:func:`stall_lower_bound_s`).

    Raises:
        ValueError: unknown mode, ``max_overlap_steps < 1``, ``interval_steps < 1``, or the
            lists differ in length.
    """
    if max_overlap_steps < 1:
        raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
    if interval_steps is not None and interval_steps < 1:
        raise ValueError(f"interval_steps must be >= 1, got {interval_steps}")
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

    def costed(m: str, blocks: tuple[tuple[int, ...], ...], stall_s: float | None = None,
               flushed_at: int | None = None) -> CopyPlan:
        if flushed_at is None:
            paid, loads = _window_terms(m, unit_bytes, grad_bytes, blocks, static_bytes)
        else:
            paid, loads = _flushed_terms(m, unit_bytes, grad_bytes, blocks, static_bytes, flushed_at)
        waits = replay_wait_s(m, unit_bytes, grad_bytes, blocks, costs, captures=flushed_at)
        if stall_s is None:
            stall_s = _model_stall(paid, loads, hides) / bw + waits
        return CopyPlan(m, blocks, stall_s, bound, median_overhead, costed=True,
                        window_s=costs.window_s, paid_s=paid / bw,
                        window_loads_s=tuple(x / bw for x in loads), flushed_at=flushed_at,
                        copy_bytes_per_s=bw, replay_wait_s=waits)

    bw = max(costs.copy_bytes_per_s, 1.0)
    hides = _hides(costs)  # what one window hides, its overhead taken off, per sample
    median_overhead = statistics.median(costs.overhead_samples_s or (costs.window_overhead_s,))
    if mode in ("sync", "async", "lazy"):
        return costed(mode, split_blocks(unit_bytes, 1))
    if mode == "auto" and _lazy_is_free(unit_bytes, hides):
        # Its one window hides the whole copy under every overhead sample: no plan predicts
        # less, and the search below takes lazy on ties, so it would return this very plan.
        # Skipping it saves the per-window search for every K (about 1 ms a request, on the
        # training thread) where the link is fast against the steps.
        return costed("lazy", split_blocks(unit_bytes, 1))
    # (stall bytes, K, preference, mode, blocks, flushed_at); auto's K = 1 is lazy, preferred
    # on ties.
    # auto: gockpt_o's window never predicts more than gockpt's (max(0, s+G-C) <= G + max(0, s-C)).
    modes = ("gockpt_o" if grad_overlap else "gockpt",) if mode == "auto" else (mode,)
    k_lo = min(min_overlap_steps, max_overlap_steps)
    # Splits sized for the median window, each scored by the mean stall over every sample;
    # where that mean is more than the median's stall (windows vary, and the splits fill
    # them), also splits sized for a slow window (the tenth percentile of what one hides),
    # which may stall less on average.
    gain = MIN_GAIN_WINDOWS * max(costs.window_s, 0.0) * bw
    ranked = np.sort(hides)  # nearest ranks: np.quantile costs a millisecond a call
    median_cap, slow_cap = (float(ranked[int(q * (len(ranked) - 1))]) for q in (0.5, 0.1))
    prefix = _prefix_sums(unit_bytes, grad_bytes)
    candidates: list[_Candidate] = []
    seen: set[tuple[str, tuple[tuple[int, ...], ...]]] = set()

    def add_splits(rank: int, m: str, cap: float) -> float:
        """Add the least-stall split of each K for windows hiding ``cap`` bytes; return the most
        any split's mean stall over the samples exceeds its stall at ``cap``."""
        spread = 0.0
        found = _window_dp(unit_bytes, grad_bytes, cap, max_overlap_steps, m == "gockpt_o",
                           overlap_last=not static_bytes)
        for k, best in enumerate(found, start=1):
            if best is None or (k < k_lo and not (k == 1 and mode == "auto")):
                continue
            m_k = m if k >= k_lo else "lazy"
            if (m_k, best[1]) in seen:
                continue
            seen.add((m_k, best[1]))
            stall = best[0]
            if len(hides) > 1:  # the DP's value is the stall at ``cap`` alone
                paid, loads = _window_terms(m, unit_bytes, grad_bytes, best[1], static_bytes, prefix)
                stall = _model_stall(paid, loads, hides) - static_bytes
                spread = max(spread, stall - best[0])
            # The split is searched without the replay's waits; they enter the choice of K.
            stall += replay_wait_s(m_k, unit_bytes, grad_bytes, best[1], costs, prefix=prefix) * bw
            candidates.append((stall, k, rank + 1 if k >= k_lo else 0, m_k, best[1], None))
        return spread

    for rank, m in enumerate(modes):
        if add_splits(rank, m, median_cap) > gain and slow_cap < median_cap:
            add_splits(rank, m, slow_cap)
    if not candidates:  # no units, or fewer than min_overlap_steps: at most one block each
        m = "lazy" if mode == "auto" else mode
        return costed(m, split_blocks(unit_bytes, 1 if m == "lazy" else max_overlap_steps))
    if interval_steps is not None:
        candidates = _with_next_request(candidates, interval_steps, unit_bytes, grad_bytes,
                                        static_bytes, next_request_shares, costs)
    least = min(c[0] for c in candidates)
    stall_bytes, k, _, m, blocks, flushed_at = min(
        (c for c in candidates if c[0] <= least + gain),
        key=lambda c: (c[1], c[2], c[0]))
    if k == 1 and mode == "auto":
        m = "lazy"
    return costed(m, blocks, (stall_bytes + static_bytes) / bw, flushed_at)


#: A candidate plan of :func:`make_plan`: (stall bytes with static excluded, K, preference,
#: mode, blocks, flushed_at).
_Candidate = tuple[float, int, int, str, tuple[tuple[int, ...], ...], int | None]


def _with_next_request(candidates: list[_Candidate], interval: int, unit_bytes: list[int],
                       grad_bytes: list[int], static_bytes: int, shares: bool, costs: Costs,
                       ) -> list[_Candidate]:
    """The candidates of :func:`make_plan` with the next request ``interval`` steps away: those
    that make it wait for the slot (K in the drain margin; K > interval unless that request
    ``shares`` the snapshot) left out where a plan whose windows end in time exists; K >
    interval charged its copy at that request."""
    def waits(k: int) -> bool:
        return interval - DRAIN_MARGIN_STEPS < k <= interval or (k > interval and not shares)

    in_time = any(c[1] <= interval - DRAIN_MARGIN_STEPS for c in candidates)
    hides = _hides(costs)
    out: list[_Candidate] = []
    for c in [c for c in candidates if not (in_time and waits(c[1]))]:
        _, k, pref, m, blocks, _ = c
        if k > interval:
            paid, loads = _flushed_terms(m, unit_bytes, grad_bytes, blocks, static_bytes, interval)
            replay = replay_wait_s(m, unit_bytes, grad_bytes, blocks, costs, captures=interval)
            c = (_model_stall(paid, loads, hides) - static_bytes
                 + replay * max(costs.copy_bytes_per_s, 1.0), k, pref, m, blocks, interval)
        out.append(c)
    return out


def _flushed_terms(mode: str, unit_bytes: list[int], grad_bytes: list[int],
                   blocks: tuple[tuple[int, ...], ...], static_bytes: int, at: int,
                   ) -> tuple[float, list[float]]:
    """(paid, loads) in bytes of a plan whose windows ``at..K-1`` are cut short by a request
    (:meth:`gockpt._windows.Windows.flush`): windows ``0..at-1`` as in :func:`_window_terms`;
    then, with the training thread waiting, the state of the later blocks and the gradients of
    the last update of the blocks copied before, and the static tensors."""
    paid, loads = _window_terms(mode, unit_bytes, grad_bytes, blocks[:at], 0)
    later_state = sum(unit_bytes[i] for b in blocks[at:] for i in b)
    grads_before = sum(grad_bytes[i] for b in blocks[:at] for i in b)
    return paid + later_state + grads_before + static_bytes, loads
