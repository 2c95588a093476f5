"""The planner: from state sizes and measured costs to a frozen copy plan. Pure: no I/O, no device.

GoCkpt §4.2: the checkpoint is split into K blocks; block j is copied during the forward/backward
of the (j+1)-th step after the request, while it cannot change; from the second window on, the
gradients of the blocks already copied are copied too (gradients first, §4.2.2), and replayed on
the CPU (§4.3). §4.2.3 bounds K (the stall model below; more steps add gradient copies). K = 1 is
DataStates-LLM's lazy copy (§V-A2): copy during forward/backward, wait only before the update.
"""

from __future__ import annotations

from dataclasses import dataclass

MULTI_STEP_MODES = ("gockpt", "gockpt_o")


@dataclass(frozen=True)
class Costs:
    """Measured costs the planner works from.

    Attributes:
        copy_bytes_per_s: host-copy (D2H) bandwidth in bytes/s.
        window_s: seconds from the end of an optimizer update to the start of the next one
            (forward + backward + anything else the loop does): the time a copy can hide in.
    """

    copy_bytes_per_s: float
    window_s: float


@dataclass(frozen=True)
class CopyPlan:
    """Which units are copied in which window.

    Attributes:
        mode: one of ``sync``, ``async``, ``lazy``, ``gockpt``, ``gockpt_o``.
        blocks: ``blocks[j]`` lists the unit indices copied in window j; ``len(blocks)`` is K.
        predicted_stall_s: the stall model's prediction for this plan, seconds.
    """

    mode: str
    blocks: tuple[tuple[int, ...], ...]
    predicted_stall_s: float

    @property
    def num_overlap_steps(self) -> int:
        """K: the number of training steps the copy spans."""
        return len(self.blocks)


def split_blocks(unit_bytes: list[int], k: int) -> tuple[tuple[int, ...], ...]:
    """Split units, in order, into ``k`` contiguous blocks of about equal bytes.

    Keeping order keeps each parameter beside its optimizer state (a unit holds both; GoCkpt
    §4.2.2) and neighbouring layers together. Fewer than ``k`` blocks are returned when there are
    fewer units than ``k``; no units give one empty block.

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
    costs: Costs,
) -> float:
    """Predicted training-thread stall of one checkpoint, in seconds (GoCkpt §4.2.3, Table 1).

    Args:
        mode: checkpoint mode.
        unit_bytes: bytes of state per unit (parameter + optimizer state).
        grad_bytes: bytes of each unit's gradient.
        blocks: the block split.
        costs: measured costs.
    """
    bw = max(costs.copy_bytes_per_s, 1.0)
    w = max(costs.window_s, 0.0)
    total = sum(unit_bytes)
    if mode in ("sync", "async"):
        return total / bw
    stall = 0.0
    grads_copied = 0  # gradient bytes of the blocks copied so far
    for j, block in enumerate(blocks):
        state = sum(unit_bytes[i] for i in block)
        if mode == "gockpt_o":
            # The previous update's gradients share window j with block j (§4.2.4).
            stall += max(0.0, (state + grads_copied) / bw - w)
        else:
            stall += max(0.0, state / bw - w)
            stall += grads_copied / bw  # copied while the training thread waits (§4.2.2)
        grads_copied += sum(grad_bytes[i] for i in block)
        if j == len(blocks) - 1:
            break
    return stall


def make_plan(
    mode: str,
    unit_bytes: list[int],
    grad_bytes: list[int],
    costs: Costs | None,
    *,
    max_overlap_steps: int,
    replayable: bool,
    min_overlap_steps: int = 1,
) -> CopyPlan:
    """Choose K and the block split for one checkpoint.

    ``auto`` picks the mode and K with the least predicted stall (ties go to fewer steps, which
    means less gradient traffic and replay); without measured costs it picks ``lazy``. Modes
    that need replay fall back to ``lazy`` when ``replayable`` is False (the caller warns).

    Args:
        mode: ``auto``, ``sync``, ``async``, ``lazy``, ``gockpt`` or ``gockpt_o``.
        unit_bytes: bytes of state per unit, in copy order.
        grad_bytes: gradient bytes per unit (0 for units without an optimizer).
        costs: measured costs, or None before anything was measured.
        max_overlap_steps: upper bound on K (>= 1).
        min_overlap_steps: lower bound on K for the multi-step modes.
        replayable: whether every optimizer can be replayed on the CPU.

    Raises:
        ValueError: unknown mode or ``max_overlap_steps < 1``.
    """
    if max_overlap_steps < 1:
        raise ValueError(f"max_overlap_steps must be >= 1, got {max_overlap_steps}")
    if len(unit_bytes) != len(grad_bytes):
        raise ValueError("unit_bytes and grad_bytes differ in length")
    if mode in MULTI_STEP_MODES and not replayable:
        mode = "lazy"
    if mode in ("sync", "async", "lazy"):
        blocks = split_blocks(unit_bytes, 1)
        stall = predict_stall_s(mode, unit_bytes, grad_bytes, blocks, costs) if costs else 0.0
        return CopyPlan(mode, blocks, stall)
    if mode in MULTI_STEP_MODES:
        if costs is None:
            k = max_overlap_steps
            return CopyPlan(mode, split_blocks(unit_bytes, k), 0.0)
        best = None
        for k in range(min(min_overlap_steps, max_overlap_steps), max_overlap_steps + 1):
            blocks = split_blocks(unit_bytes, k)
            s = predict_stall_s(mode, unit_bytes, grad_bytes, blocks, costs)
            if best is None or s < best.predicted_stall_s - 1e-9:
                best = CopyPlan(mode, blocks, s)
        assert best is not None
        return best
    if mode == "auto":
        if costs is None:
            return CopyPlan("lazy", split_blocks(unit_bytes, 1), 0.0)
        candidates = [make_plan("lazy", unit_bytes, grad_bytes, costs, max_overlap_steps=1,
                                replayable=replayable)]
        if replayable and max_overlap_steps > 1:
            for m in ("gockpt_o", "gockpt"):
                candidates.append(make_plan(m, unit_bytes, grad_bytes, costs,
                                            max_overlap_steps=max_overlap_steps, replayable=True,
                                            min_overlap_steps=min_overlap_steps))
        return min(candidates, key=lambda p: (round(p.predicted_stall_s, 6), p.num_overlap_steps))
    raise ValueError(f"unknown mode {mode!r}")
