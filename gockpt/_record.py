"""One save's record: what it copies, into which host buffers, and the phase it is in.

``Engine.save`` makes it on the training thread; :mod:`gockpt._windows` moves it through its copy
windows there; :mod:`gockpt._pipeline` replays onto it, persists it and resolves its handle.

Saves requested at one step share one host snapshot (:class:`Share`, :func:`find_leader`): the
first one (the leader) is planned and copied as usual; a later request at the same step whose
plan allows the leader's captured step joins it (:func:`join_record`) with its own path, state,
files and handle, and the slot goes back to the pool once every one of them has released it.
"""

from __future__ import annotations

import collections
import enum
import logging
import threading
import uuid
import warnings
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from time import perf_counter
from typing import TYPE_CHECKING, Any

import torch

from ._watch import same_sample, state_sample
from .format import ShardLayout
from .handle import CheckpointMetrics, SaveHandle
from .layout import StateLayout
from .plan import CopyPlan
from .snapshot import SlotLayout, host_view
from .transfer import CopyTicket, Drain, Slot, SlotPool
from .writer import CheckpointWriter, TensorFile, plan_tensor_files

if TYPE_CHECKING:
    from ._planner import Planner
    from .config import GoCkptConfig


log = logging.getLogger("gockpt")

#: A save that waits longer than this for its host slot (seconds, the ``slot_wait`` stall, at
#: its request and at its windows on a borrowed slot) waits on storage: the save before it is
#: still being written out. ``SLOT_WAIT_WARN_SAVES`` such saves in a row are warned about, once
#: per engine (:class:`StorageLag`).
SLOT_WAIT_WARN_S = 0.05
SLOT_WAIT_WARN_SAVES = 3


class StorageLag:
    """Tells the user, once, that checkpoints are requested faster than storage persists them.

    A save's host slot is written out by its persist before the next save can copy into it
    (DataStates-LLM §V-A4: buffers recycled as they are flushed); where every request finds the
    one before still writing, each waits (``slot_wait``) for the storage's deficit, whatever
    the plan. Only a longer interval or faster storage removes that wait; more host memory
    (``host_buffer_bytes``) absorbs a burst of requests, not a lasting deficit.
    """

    def __init__(self) -> None:
        self.run = 0  # requests in a row that waited longer than SLOT_WAIT_WARN_S
        self.warned = False
        self._recent: collections.deque[CheckpointMetrics] = collections.deque(
            maxlen=SLOT_WAIT_WARN_SAVES + 1)  # the long waits and the save before them

    def note(self, metrics: CheckpointMetrics) -> None:
        """Count the whole slot wait of a save with a snapshot of its own, handed off, whose
        slot was not newly allocated (an allocation, pinning included, is no wait on storage);
        warn on the ``SLOT_WAIT_WARN_SAVES``-th long one in a row, with how long the latest of
        them whose persist has ended took to write out (``persist_s``): the least time between
        checkpoints that storage keeps up with."""
        waited = metrics.stall_by_phase_s.get("slot_wait", 0.0)
        self.run = self.run + 1 if waited > SLOT_WAIT_WARN_S else 0
        self._recent.append(metrics)
        if self.run >= SLOT_WAIT_WARN_SAVES and not self.warned:
            self.warned = True
            # persist_s is set by the persist thread as it ends (a float: read as is).
            done = [m for m in self._recent if m.persist_s > 0]
            took = ""
            if done:
                m = done[-1]
                took = (f" Each takes about {m.persist_s:.2f} s to write out "
                        f"({m.persist_bytes / 1e6:.3g} MB at {m.persist_gbps * 1e3:.3g} MB/s): "
                        "request them at least that far apart, or write to faster storage;")
            log.warning(
                "gockpt: %d checkpoints in a row each waited over %.2f s (the latest "
                "%.2f s) for the checkpoint before to be written out: checkpoints are requested "
                "faster than storage persists them.%s more host memory (host_buffer_bytes) only "
                "absorbs a burst.", self.run, SLOT_WAIT_WARN_S, waited,
                took or " Checkpoint less often or write to faster storage;")


class Phase(enum.Enum):
    """Where a save is in its lifecycle.

    Multi-step modes (``lazy`` included): REQUESTED, then COPYING and COPIED once per block (a
    flush copies the rest at once), then FINALIZED (handed to the pipeline, failed saves too),
    then DONE or FAILED. ``sync`` and ``async``: REQUESTED, then CAPTURED (handed to the
    pipeline without the finalize step), then DONE or FAILED. A follower (:class:`Share`) goes
    from REQUESTED to FINALIZED with its leader (at once when the leader was handed off, or
    alone when it fails or is cancelled). :func:`take_host` counts handed-off saves whose
    leader is handed off too as ones that free a slot without training.

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


class Share:
    """The saves using one host snapshot, the leader first.

    The leader was planned with the snapshot and drives its copies, gradient captures and
    replays (:mod:`gockpt._windows`, :mod:`gockpt._pipeline`); the others (followers) joined it
    at the step it is pinned to and take only their own state (``state_fn``), files and handle.
    A failure of the copies fails all of them; a save's own failure or cancel fails it alone:
    the leader then goes on driving while a follower still wants the snapshot.

    It holds its saves weakly (no reference cycle keeps a finished save's tensors alive until
    the garbage collector runs); a follower holds its leader (:attr:`SaveRecord.leader`).
    """

    def __init__(self, leader: SaveRecord) -> None:
        self._refs = [weakref.ref(leader)]

    @property
    def leader(self) -> SaveRecord:
        r = self._refs[0]()
        assert r is not None, "read through a live save, the leader is alive"
        return r

    @property
    def records(self) -> list[SaveRecord]:
        """The saves still alive, the leader first."""
        return [r for ref in self._refs if (r := ref()) is not None]

    def add(self, r: SaveRecord) -> None:
        self._refs.append(weakref.ref(r))

    def remove(self, r: SaveRecord) -> None:
        self._refs = [ref for ref in self._refs if ref() is not r]

    def alive(self) -> bool:
        """Whether some save still wants the snapshot (neither cancelled nor failed)."""
        return any(not r.cancel.is_set() for r in self.records)


@dataclass
class SaveRecord:
    seq: int
    # The directory as Engine.save resolved it at the request (gockpt.fsutil.path_key), one
    # spelling per directory: saves of one directory supersede one another, and Engine.remove
    # cancels them, by it.
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
    # Views copied since the last version check whose slot bytes will hold the tensor unchanged
    # once it passes: (offset, bytes, fingerprint) for Slot.held (frozen_copy="when_changed").
    to_remember: list[tuple] = field(default_factory=list)
    slot_released: bool = False  # its hold of the slot was dropped (Pipeline._release)
    # The slot was borrowed while an earlier save's persist still read it: copies into a range
    # wait until that persist has written it out (gockpt.transfer.Drain).
    borrowed: Drain | None = None
    # Its persist lets the next save borrow its slot (SlotPool.make_lendable): what it has yet
    # to read; ``lending.lent`` once borrowed. Kept after the persist (find_leader reads it).
    lending: Drain | None = None
    extra: Any = None  # the state tree taken at the captured step (gockpt.snapshot.to_skeleton)
    grad_turn: int = 0
    grad_tickets: list[CopyTicket] = field(default_factory=list)
    # The gradient copies that overlap the open window (gockpt_o), and how many of
    # grad_tickets were there when it opened (Windows._open_window).
    window_grads: list[CopyTicket] = field(default_factory=list)
    grads_seen: int = 0
    # The last window is opened at the end of the capture at this step's boundary, not at the
    # update (Windows.after_update): nothing the capture reads from the device queues behind it.
    open_pending: bool = False
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
    # The saves using this save's host snapshot (this one alone unless others joined it).
    share: Share = field(default=None)  # type: ignore[assignment]
    leader: SaveRecord | None = None  # a follower: the save whose snapshot it shares
    # (step, version counters of every tracked tensor) the snapshot's contents stand for: set at
    # the request, and again where a flush finishes the save at the current step.
    pinned: tuple[int, tuple[int, ...]] = (-1, ())
    # The leader: its snapshot's state was taken (whether or not its own state_fn worked).
    # A follower: its own state was taken.
    captured: bool = False
    # Its slot's buffers were newly allocated or its views built for it: its request and copies
    # pay first-touch costs no later save into the slot pays (_windows.CostSamples).
    cold: bool = False
    # Seconds of its request spent finishing other saves' windows (their "flush" stall): left
    # out of its own stall ("slot_wait", and "request" or "copy").
    flushed_others_s: float = 0.0
    # Seconds its copies waited for a borrowed slot's bytes to be written out (part of
    # "slot_wait"): predicted per save (predict_slot_wait_s), so not a fixed cost.
    drain_wait_s: float = 0.0
    # frozen_copy="when_changed": per shard whose every tensor the slot held unchanged when the
    # save was handed off, those held entries (HeldTensors.entries): the persist links the
    # shard's file from the last checkpoint that wrote the same entries.
    held_entries: dict[int, tuple] | None = None
    # A multi-step save: the writes to its copied blocks outside an update, until its step is
    # taken (gockpt._watch.EditWatch); after that, the writes to the block still being copied.
    watch: Any = None
    # Units written outside an update between their copy and the captured step: their live
    # tensors are copied with the state tree at the capture, not taken from the host copy.
    edited: set[int] = field(default_factory=set)
    # Units an update gave a gradient no dense buffer holds (a sparse embedding's): their host
    # copy cannot be brought forward by a replay, so, as ``edited``, they are taken live at the
    # capture.
    live_units: set[int] = field(default_factory=set)
    # The run it records (meta["run"]; Engine.run_for).
    run: int = 0
    # CUDA: the sampled comparison of the block copied after the capture, read by the persist
    # before it writes ((pinned host flag, event) pairs; gockpt._watch.EditWatch.sampled_later).
    late_edits: list | None = None
    # Sampled parameter and buffer contents when the snapshot was pinned
    # (gockpt._watch.state_sample): a request at that step shares it only if they still hold
    # (no .data write, no batch-norm forward since).
    pinned_sample: list | None = None
    # (step, version counters, samples) of its tensors when its state was captured: a flush
    # pins the snapshot to its step anew only while they still hold (Windows.flush).
    capture_pin: tuple | None = None

    def __post_init__(self) -> None:
        if self.share is None:
            self.share = Share(self)

    @property
    def metrics(self) -> CheckpointMetrics:
        return self.handle.metrics

    @property
    def num_blocks(self) -> int:
        return len(self.plan.blocks)

    @property
    def handed_off(self) -> bool:
        return self.phase in _HANDED_OFF

    def drain(self) -> None:
        """Wait for the copies that fill this save's slot: its own and, for a follower (a save
        sharing another's snapshot, which queued none), the leader's, whose last copy may still
        be in flight on a copy stream when both are handed to the persist pool."""
        if self.leader is not None:
            self.leader.drain()
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
    grad_bytes: tuple[int, int],
    target: int,
    t_request: float,
    pinned: tuple[int, tuple[int, ...]],
    writer: CheckpointWriter | None = None,
    files: list[TensorFile] | None = None,
) -> SaveRecord:
    """A record whose views map every tracked tensor (and gradient) onto ``slot``; ``grad_bytes``:
    the bytes each gradient buffer needs (:meth:`gockpt._planner.Planner.grad_layout`);
    ``pinned``: (step, :func:`state_versions`) at the request; ``files``:
    ``writer.tensor_files(layout)`` (None: GoCkpt's shards)."""
    handle.metrics.host_bytes = slot.nbytes
    slot.held.keep_only(layout, slot_layout.offsets)
    # The views of one layout into one slot are the same every save: made once, read-only after.
    cached = slot.views
    cold = slot.fresh
    slot.fresh = False
    if cached is not None and cached[0] is layout and cached[1] is slot_layout:
        views = cached[2]
    else:
        cold = True
        views = {e.key: host_view(slot.data, slot_layout.offsets[e.key], e.tensor)
                 for e in layout.entries}
        slot.views = (layout, slot_layout, views)
    grad_views = _grad_views(slot, layout, grad_offsets, grad_bytes)
    shards, segments = _files(layout, slot_layout, files)
    return SaveRecord(seq, path, handle, plan, layout, slot, views, grad_views, shards,
                      slot_layout.bases, state_fn, target=target, t_request=t_request,
                      writer=writer, shard_segments=segments, pinned=pinned, cold=cold)


def _grad_views(slot: Slot, layout: StateLayout, grad_offsets: dict[int, int],
                grad_bytes: tuple[int, int]) -> list[dict[int, torch.Tensor]]:
    """Per gradient buffer of ``slot``: unit index -> its gradient's view at ``grad_offsets``,
    for the units whose gradient fits in the ``grad_bytes`` that buffer needs. Views are kept on
    the slot per (unit, offset) for its latest layout: making one costs two ``Tensor.view``
    calls (about 10 us), on the training thread, for every unit of every save."""
    cached = slot.grad_view_cache
    # A lent slot may get larger gradient buffers (SlotPool): views of the old ones are dropped.
    if cached is None or cached[0] is not layout or any(
            a is not b for a, b in zip(cached[1], slot.grads, strict=True)):
        cached = slot.grad_view_cache = (layout, tuple(slot.grads), [{} for _ in slot.grads])
    units = layout.units
    out: list[dict[int, torch.Tensor]] = []
    for g, need, memo in zip(slot.grads, grad_bytes, cached[2], strict=True):
        if len(memo) > 8 * len(units):  # offsets of many plans: start over
            memo.clear()
        views = {}
        for i, off in grad_offsets.items():
            if off + units[i].grad_bytes <= need:
                v = memo.get((i, off))
                if v is None:
                    v = memo[(i, off)] = host_view(g, off, units[i].param_entry.tensor)
                views[i] = v
        out.append(views)
    return out


def _files(layout: StateLayout, slot_layout: SlotLayout, files: list[TensorFile] | None,
           ) -> tuple[list[ShardLayout], list[list[tuple[int, int]]] | None]:
    if files is not None:
        return plan_tensor_files(files, layout, slot_layout)
    # File names unique to this save: overwriting a file that the checkpoint published at the
    # same path names would corrupt it.
    return slot_layout.with_prefix(f"shard-{uuid.uuid4().hex[:8]}"), None


def state_versions(layout: StateLayout) -> tuple[int, ...]:
    """The version counter of every tensor of ``layout``: an in-place change bumps one."""
    return tuple(e.versioned._version for e in layout.entries)


def unit_versions(layout: StateLayout) -> tuple[int, ...]:
    """The version counters of the optimizers' tensors of ``layout`` (parameters and their
    state; no buffer or frozen parameter): what an optimizer update writes."""
    return tuple(e.versioned._version for u in layout.units for e in u.entries)


def find_leader(records: list[SaveRecord], *, version: int, layout: StateLayout, plan: CopyPlan,
                exact_k: bool, versions: tuple[int, ...],
                sample: list | None = None) -> SaveRecord | None:
    """A save in flight whose snapshot a request at step ``version`` planned as ``plan`` may share.

    It may when it leads its snapshot, still holds its slot (its files not yet all written)
    and did not lend it to a later save,
    neither failed nor was cancelled, has the same layout, its
    snapshot is pinned to this step with the same tensor ``versions`` (requested at this step, or
    finished at it by a flush, and nothing changed since), and its captured step ``target`` is
    one ``plan`` allows: ``K' = target - version + 1 <= K`` (``== K`` when ``exact_k``: the ranks
    of a sharded engine agreed on K and must capture the same step whether they share or not).
    ``sync`` never shares; ``async`` only a snapshot already copied at this step. ``sample``:
    the parameters' sampled contents now, compared with the leader's when it was pinned
    (:func:`gockpt._watch.state_sample`: writes through ``.data`` and a batch norm's running
    statistics move no version counter).
    """
    if plan.mode == "sync":
        return None
    for x in reversed(records):
        if x.share.leader is not x or x.pinned[0] != version or x.layout is not layout \
                or x.plan.mode == "sync" or x.failed is not None or x.cancel.is_set() \
                or x.phase in (Phase.DONE, Phase.FAILED) or x.handle.done() or x.slot_released \
                or (x.lending is not None and x.lending.lent):
            continue
        k = x.target - version + 1
        if k > plan.num_overlap_steps or (exact_k and k != plan.num_overlap_steps):
            continue
        if plan.mode == "async" and not (x.handed_off and k == 1):
            continue
        if x.pinned[1] != versions:
            continue
        if sample is not None and x.pinned_sample is not None \
                and not same_sample(sample, x.pinned_sample):
            continue
        return x
    return None


def moved_since_pinned(records: list[SaveRecord], version: int, layout: StateLayout | None) -> bool:
    """Whether a save not yet captured leads a snapshot pinned to step ``version`` while the
    state has moved on since (another layout, other tensor versions or sampled contents: a
    forward's batch-norm statistics inside a gradient accumulation): a request now cannot share
    it (:func:`find_leader`), and with no free slot finishes it at this step. A sharded engine's
    ranks agree on it (each sees only its own part of the state)."""
    pinned = [x for x in records if x.share.leader is x and not x.captured and x.pinned[0] == version
              and x.failed is None and not x.handle.done()]
    if not pinned:
        return False
    if layout is None or any(x.layout is not layout for x in pinned):
        return True
    versions, sample = state_versions(layout), state_sample(layout)
    return any(x.pinned[1] != versions or (x.pinned_sample is not None and not same_sample(sample, x.pinned_sample))
               for x in pinned)


def join_record(seq: int, path: str, handle: SaveHandle, leader: SaveRecord,
                slot_layout: SlotLayout, state_fn: Callable[[], Any] | None, *, version: int,
                t_request: float, writer: CheckpointWriter | None = None,
                files: list[TensorFile] | None = None) -> SaveRecord:
    """A follower of ``leader`` (:class:`Share`, requested at step ``version``): the leader's
    snapshot, plan and captured step, with its own files, state and handle. The caller holds
    the slot once more for it (:meth:`gockpt.transfer.SlotPool.share`)."""
    m = handle.metrics
    m.host_bytes = leader.metrics.host_bytes
    m.host_shared = leader.metrics.host_shared = True
    m.mode = leader.plan.mode
    m.num_overlap_steps = leader.target - version + 1
    shards, segments = _files(leader.layout, slot_layout, files)
    s = SaveRecord(seq, path, handle, leader.plan, leader.layout, leader.slot, leader.views,
                   leader.grad_views, shards, leader.shard_bases, state_fn, target=leader.target,
                   t_request=t_request, writer=writer, shard_segments=segments,
                   share=leader.share, leader=leader, pinned=leader.pinned)
    leader.share.add(s)
    return s


def take_host(pool: SlotPool, records: list[SaveRecord], sizes: tuple[int, tuple[int, int]], *,
              find: Callable[[], SaveRecord | None], flush: Callable[[], None], wait: bool,
              timeout_s: float | None, path: str,
              agree: Callable[[bool], bool] | None = None) -> tuple[SaveRecord | None, Slot | None]:
    """The host buffers of a new save: ``(leader, None)`` to share ``leader``'s snapshot (``find``),
    ``(None, slot)`` for a slot of its own of ``sizes`` (data bytes, gradient buffer bytes), or
    ``(None, None)``: none free and not ``wait`` (``when_full="skip"``), or none freed within
    ``timeout_s`` seconds (warned).

    With ``wait`` and no slot free: unless a save already in the pipeline will free one, the
    saves in their copy windows are finished at this step (``flush``), since they only advance
    with training; one of them then pinned to this step may be shared after all. ``agree``
    (sharded engines; a collective every rank reaches once per save): whether any rank
    finishes them, from this rank's need; then every rank does, so that their parts of those
    saves still hold one step (shares of different sizes fit different numbers of slots in one
    ``host_buffer_bytes``).
    """
    leader = find()
    shared = leader is not None and pool.share(leader.slot)
    slot = None if shared else pool.acquire(*sizes, block=False, lend=True)
    try:
        short = slot is None and not shared and wait and not _frees_without_training(records)
        if agree is not None:
            short = agree(short)
        if short:
            flush()
            if slot is None and not shared:
                leader = find()
                shared = leader is not None and pool.share(leader.slot)
        if shared:
            return leader, None
        if slot is None and wait:
            slot = pool.acquire(*sizes, block=True, timeout=timeout_s, lend=True)
            if slot is None:
                # stacklevel: this, make_record, Engine.save, its caller.
                warnings.warn(f"gockpt: no host slot freed within slot_wait_timeout_s; skipped "
                              f"checkpoint {path} (the checkpoints in flight are still being "
                              "persisted: storage slower than the checkpoint interval?)", stacklevel=4)
    except BaseException:
        if shared:
            pool.release(leader.slot)  # type: ignore[union-attr]
        elif slot is not None:
            pool.release(slot)
        raise
    return None, slot


def _frees_without_training(records: list[SaveRecord]) -> bool:
    """Whether some slot will come back without more training steps: every save still holding
    it is in the pipeline (a save in its copy windows advances only with training)."""
    holders: dict[int, list[SaveRecord]] = {}
    for x in records:
        if not x.slot_released and not x.handle.done():
            holders.setdefault(id(x.slot), []).append(x)
    return any(all(x.handed_off and x.share.leader.handed_off for x in xs) for xs in holders.values())


def make_record(pool: SlotPool, records: list[SaveRecord], planner: Planner, *, seq: int, path: str,
                handle: SaveHandle, plan: CopyPlan, layout: StateLayout,
                state_fn: Callable[[], Any] | None, version: int, t_request: float,
                writer: CheckpointWriter | None, flush: Callable[[], None], config: GoCkptConfig,
                step_s: float | None = None) -> tuple[SaveRecord | None, SaveRecord | None]:
    """The record of a request at step ``version`` (``Engine.save``) and the leader whose snapshot
    it shares (None: a slot of its own); ``(None, None)`` when it got no host buffers
    (:func:`take_host`). The wait is counted as the ``slot_wait`` stall; on a borrowed slot it
    is also predicted (:func:`predict_slot_wait_s`, with ``step_s`` seconds between updates).

    Raises:
        ValueError: ``host_buffer_bytes`` cannot hold one snapshot of this plan.
    """
    agree = planner.agree_flush
    joined = 0  # the sharded agreement's gathers this rank has entered (two per request)
    leader: SaveRecord | None = None  # what this request holds: the leader it shares, or
    slot: Slot | None = None  # a slot of its own (given back if it fails)

    def agreed(flag: bool) -> bool:
        nonlocal joined
        joined += 1
        return agree(flag)  # type: ignore[misc]

    try:
        slot_layout = planner.slot_layout(layout)
        files = writer.tensor_files(layout) if writer is not None else None
        grad_offsets, grad_bytes = planner.grad_layout(layout, plan)
        planner.check_host_budget(slot_layout.nbytes + sum(grad_bytes))
        pinned = (version, state_versions(layout))
        sample = state_sample(layout)  # what a later request at this step compares, and this one
        tw = perf_counter()
        find = partial(find_leader, records, version=version, layout=layout, plan=plan,
                       exact_k=planner.agree is not None, versions=pinned[1], sample=sample)
        flushed_s = 0.0

        def timed_flush() -> None:
            # A flush is the stall of the saves it finishes ("flush"), not this request's wait.
            nonlocal flushed_s
            tf = perf_counter()
            flush()
            flushed_s += perf_counter() - tf

        leader, slot = take_host(pool, records, (slot_layout.nbytes, grad_bytes), find=find,
                                 flush=timed_flush, wait=config.when_full == "wait",
                                 timeout_s=config.slot_wait_timeout_s, path=path,
                                 agree=agreed if agree is not None else None)
        drain = slot.drain if slot is not None else None
        if drain is not None and drain.done:
            drain = None  # the save before read everything: nothing to wait for
        handle.metrics.slot_borrowed = drain is not None
        free, drain_wait_s = True, 0.0
        if drain is not None:
            windows = _window_ranges(layout, plan, slot_layout)
            wait = predict_slot_wait_s(drain, windows, pool.last_drain_pace, step_s)
            handle.metrics.predicted_slot_wait_s = wait
            handle.metrics.predicted_stall_s += wait
            td = perf_counter()
            free = _first_bytes_free(drain, windows[0], tw, config.slot_wait_timeout_s)
            drain_wait_s = perf_counter() - td
        if not free:
            pool.release(slot)
            # stacklevel: this, Engine.save, its caller.
            warnings.warn(f"gockpt: no host slot freed within slot_wait_timeout_s; skipped "
                          f"checkpoint {path} (the checkpoint in flight is still being written out: "
                          "storage slower than the checkpoint interval?)", stacklevel=3)
            slot = None
        if agree is not None:
            # Sharded: a part without host buffers (skipped, or its wait timed out) means no
            # checkpoint; every rank skips it then, as one rank alone skipping failed them all.
            got = leader is not None or slot is not None
            if agreed(not got) and got:
                pool.release(leader.slot if leader is not None else slot)  # type: ignore[union-attr]
                leader = slot = None
                log.info("gockpt: skipped checkpoint %s: another rank has no part for it (no host "
                         "slot, or its request failed)", path)
    except BaseException:
        if leader is not None or slot is not None:
            pool.release(leader.slot if leader is not None else slot)  # type: ignore[arg-type]
        # Every rank enters the agreement's two gathers once per request, whatever fails here
        # (``joined`` counts those entered before the failure).
        if agree is not None:
            try:
                if joined == 0 and agree(False):
                    flush()  # the others finish their saves in flight at this step: so must this rank
            finally:
                if joined <= 1:
                    agree(True)  # no buffers here: they skip
        raise
    handle.metrics.add_stall("slot_wait", max(0.0, perf_counter() - tw - flushed_s))
    if leader is not None:
        record = join_record(seq, path, handle, leader, slot_layout, state_fn, version=version,
                             t_request=t_request, writer=writer, files=files)
    elif slot is None:
        return None, None
    else:
        record = new_record(seq, path, handle, plan, layout, slot, slot_layout, grad_offsets,
                            state_fn, grad_bytes=grad_bytes,
                            target=version + plan.num_overlap_steps - 1, t_request=t_request,
                            pinned=pinned, writer=writer, files=files)
        record.pinned_sample = sample
        record.borrowed = drain
        record.drain_wait_s = drain_wait_s
    record.flushed_others_s = flushed_s
    return record, leader


def _window_ranges(layout: StateLayout, plan: CopyPlan, slot_layout: SlotLayout
                   ) -> list[list[tuple[int, int]]]:
    """The slot byte ranges each copy window of ``plan`` writes, in window order (at least
    one): the first with the static tensors (taken at the request), one group for
    ``sync``/``async``."""
    windows = [plan.blocks] if plan.mode in ("sync", "async") else [[b] for b in plan.blocks]
    out = []
    for j, blocks in enumerate(windows or [[]]):
        entries = [e for b in blocks for i in b for e in layout.units[i].entries]
        if j == 0:
            entries += layout.static
        out.append([(slot_layout.offsets[e.key], slot_layout.offsets[e.key] + e.spec.nbytes)
                    for e in entries])
    return out


def predict_slot_wait_s(drain: Drain, windows: list[list[tuple[int, int]]],
                        last_pace: tuple[int, float], step_s: float | None) -> float:
    """The predicted ``slot_wait`` of a save that borrowed its slot while ``drain``'s persist
    still writes it out, seconds. The request waits for the bytes of the first window; window
    ``j``, opening ``j`` updates later (``step_s`` seconds apart), for its block's (``windows``:
    the slot byte ranges each window writes, :func:`_window_ranges`). The persist
    is modelled as in :meth:`Drain.pending_through`, at the pace of its bytes written so far
    pooled with those of the latest persist that wrote all of it, or ended (``last_pace``,
    :meth:`Drain.pace`: early in a persist its own few chunks alone misjudge it); 0.0 with
    neither. So the wait is ``max(0, max_j(pending_j / pace - j * step_s))`` (a wait also
    delays the windows after it, which the max accounts for); without ``step_s``, the
    request's alone. Once storage falls behind the checkpoint rate, more windows only move
    the wait to later ones.

    An extension of GoCkpt's stall model, which assumes each persist ends before the next
    request; the wait comes from reusing host buffers as they are written out (DataStates-LLM
    §V-A4).
    """
    nbytes, seconds = drain.pace()
    nbytes, seconds = nbytes + last_pace[0], seconds + last_pace[1]
    if not nbytes:
        return 0.0
    pace = nbytes / seconds
    pending = drain.pending_through(windows if step_s else windows[:1])
    return max(0.0, *(n / pace - j * (step_s or 0.0) for j, n in enumerate(pending)))


def _first_bytes_free(drain: Drain, ranges: list[tuple[int, int]], t0: float,
                      timeout_s: float | None) -> bool:
    """Wait (bounded by ``timeout_s`` since ``t0``) until the bytes a borrowed slot takes at the
    request (``ranges``: the first window's blocks, all of them for ``sync``/``async``, and the
    static tensors) are written out by the save it was borrowed from."""
    left = None if timeout_s is None else max(0.0, timeout_s - (perf_counter() - t0))
    return drain.wait_free(ranges, left)


def edited_after_capture(path: str) -> str:
    """The message of a save whose block still being copied was written after its step was taken."""
    return (f"{path}: a tensor changed while it was copied, after its step was taken (edited "
            "outside optimizer.step()); this checkpoint is not written. Call engine.flush() "
            "before such edits, or save with mode='async'")
