"""One save's record: what it copies, into which host buffers, and the phase it is in.

``Engine.save`` makes it on the training thread; :mod:`gockpt._windows` moves it through its copy
windows there; :mod:`gockpt._pipeline` replays onto it, persists it and resolves its handle.
"""

from __future__ import annotations

import enum
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .format import ShardLayout
from .handle import CheckpointMetrics, SaveHandle
from .layout import StateLayout
from .plan import CopyPlan
from .snapshot import SlotLayout, host_view
from .transfer import CopyTicket, Slot
from .writer import CheckpointWriter, TensorFile, plan_tensor_files


class Phase(enum.Enum):
    """Where a save is in its lifecycle.

    Multi-step modes (``lazy`` included): REQUESTED, then COPYING and COPIED once per block (a
    flush copies the rest at once), then FINALIZED (handed to the pipeline, failed saves too),
    then DONE or FAILED. ``sync`` and ``async``: REQUESTED, then CAPTURED (handed to the
    pipeline without the finalize step; ``Engine.save`` waiting for a slot counts only
    FINALIZED saves as ones that free a slot without training), then DONE or FAILED.

    The training thread writes the phase until the hand-off, the pipeline afterwards. Whether
    the non-tensor state was taken is :attr:`SaveRecord.captured`, not a phase: a multi-step
    save takes it while its last copy window is still open.
    """

    REQUESTED = "requested"  # planned, holding a host slot; no copy queued yet
    COPYING = "copying"  # the copy window of block ``window`` is open
    COPIED = "copied"  # block ``window``'s window ended; the next one opens at the next update
    CAPTURED = "captured"  # sync/async: every block copied and the state taken at the request
    FINALIZED = "finalized"  # windows over, or failed on the training thread: in the pipeline
    DONE = "done"  # the handle holds the metrics
    FAILED = "failed"  # the handle holds the error


_HANDED_OFF = (Phase.CAPTURED, Phase.FINALIZED, Phase.DONE, Phase.FAILED)


@dataclass
class SaveRecord:
    seq: int
    path: str
    handle: SaveHandle
    plan: CopyPlan
    layout: StateLayout
    slot: Slot
    views: dict[str, torch.Tensor]
    grad_views: list[dict[int, torch.Tensor]]
    shards: list[ShardLayout]
    shard_bases: list[int]
    state_fn: Callable[[], Any] | None
    target: int
    t_request: float
    phase: Phase = Phase.REQUESTED  # written by the training thread until handed off
    window: int = 0
    tickets: dict[int, CopyTicket] = field(default_factory=dict)
    versions: list[tuple[torch.Tensor, int]] = field(default_factory=list)
    extra: Any = None  # the state tree taken at the captured step (gockpt.snapshot.to_skeleton)
    grad_turn: int = 0
    grad_tickets: list[CopyTicket] = field(default_factory=list)
    cancel: threading.Event = field(default_factory=threading.Event)
    # Written by the training thread and the replay thread, in any phase: data, not a phase.
    failed: BaseException | None = None
    # The failure is an outside edit's (a tracked tensor changed before its copy): logged by
    # the persist, never raised to the training thread.
    overtaken: bool = False
    writer: CheckpointWriter | None = None  # None: GoCkpt's own layout
    # Per shard, the slot byte ranges of its data in file order (a writer's files); None: one
    # range per shard, from shard_bases.
    shard_segments: list[list[tuple[int, int]]] | None = None

    @property
    def metrics(self) -> CheckpointMetrics:
        return self.handle.metrics

    @property
    def num_blocks(self) -> int:
        return len(self.plan.blocks)

    @property
    def captured(self) -> bool:
        return self.extra is not None

    @property
    def handed_off(self) -> bool:
        return self.phase in _HANDED_OFF

    def drain(self) -> None:
        """Wait for the copies still writing into this save's slot (before the slot is reused)."""
        for t in [*self.tickets.values(), *self.grad_tickets]:
            try:
                t.wait()
            except BaseException:  # noqa: BLE001 - the save already failed or was cancelled
                pass


def new_record(
    seq: int,
    path: str,
    handle: SaveHandle,
    plan: CopyPlan,
    layout: StateLayout,
    slot: Slot,
    slot_layout: SlotLayout,
    grad_offsets: dict[int, int],
    state_fn: Callable[[], Any] | None,
    *,
    target: int,
    t_request: float,
    writer: CheckpointWriter | None = None,
    files: list[TensorFile] | None = None,
) -> SaveRecord:
    """A record whose views map every tracked tensor (and gradient) onto ``slot``; ``files``:
    ``writer.tensor_files(layout)`` (None: GoCkpt's shards)."""
    handle.metrics.host_bytes = slot.data.numel() + sum(g.numel() for g in slot.grads)
    views = {}
    for e in layout.entries:
        views[e.key] = host_view(slot.data, slot_layout.offsets[e.key], e.tensor)
    grad_views = [
        {i: host_view(g, off, layout.units[i].param_entry.tensor) for i, off in grad_offsets.items()}
        for g in slot.grads
    ]
    # File names unique to this save: overwriting a file that the checkpoint published at the
    # same path names would corrupt it.
    shards = slot_layout.with_prefix(f"shard-{uuid.uuid4().hex[:8]}")
    segments = None
    if files is not None:
        shards, segments = plan_tensor_files(files, layout, slot_layout)
    return SaveRecord(seq, path, handle, plan, layout, slot, views, grad_views, shards,
                      slot_layout.bases, state_fn, target=target, t_request=t_request,
                      writer=writer, shard_segments=segments)
