"""The background side of the engine: replay thread, persist pool and the one error channel.

The replay thread takes the queue in order: a gradient record (:meth:`Pipeline.submit_replay`) is
applied to the host copies of its blocks with the optimizer's update rule (GoCkpt §4.3); a
finalized save (:meth:`Pipeline.finalize`) goes to the persist pool once the replays queued
before it are done. The persist writes the shards, the manifest and the publish
(:func:`gockpt.persist.persist`), releases the host slot and resolves the save's handle. Errors
the training thread must see wait in the error channel until :meth:`Pipeline.raise_errors`.
Every large operation on these threads releases the GIL (torch kernels, file writes, xxh3,
fsync); :mod:`gockpt._trace` records them per thread and phase when turned on.
"""

from __future__ import annotations

import collections
import io
import logging
import queue
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from functools import partial
from time import perf_counter
from typing import Any

import torch
from torch.optim import Optimizer

from . import _trace, fsutil
from ._planner import ReplayBackends
from ._record import Phase, SaveRecord, edited_after_capture
from .config import GoCkptConfig
from .errors import CheckpointCancelledError, CheckpointTornError
from .handle import CheckpointMetrics, SaveHandle
from .layout import Unit
from .persist import (PersistRequest, PersistResult, io_threads, io_threads_cap,
                      lower_thread_priority, persist, slot_chunks)
from .replay import TorchReplay
from .snapshot import references, resolve
from .targets import FileOrigin, LocalTarget, open_target
from .transfer import CopyTicket, Drain, SlotPool
from .writer import Snapshot

log = logging.getLogger("gockpt")

# One optimizer update's gradients of a save: (optimizer index, optimizer class, the param
# groups' hyperparameters, unit indices, gradient buffer turn, None or a host copy of
# GradScaler's ``found_inf`` for that update: nonzero, the update was skipped).
ReplayRecord = tuple[int, type, list, list[int], int, "torch.Tensor | None"]


def _sync_edited(s: SaveRecord) -> None:
    """Put the live copies that ``s``'s capture took of the units written outside an update
    during its copy windows (:attr:`SaveRecord.edited`), or given sparse gradients
    (:attr:`SaveRecord.live_units`; both held in its state tree), into the slot
    views of those units. The views hold the copy from before the edit, brought forward by the
    replay; the state tree's loaders read the tree, but a writer whose files are built from the
    slot (Accelerate's ``model.safetensors``) wrote those stale bytes: a checkpoint that was not
    the captured step's. Runs once per snapshot, after its replays, before its persists."""
    ex = s.extra
    if not (s.edited or s.live_units) or not isinstance(ex, dict):
        return
    model, optimizers = ex.get("model"), ex.get("optimizers") or []
    for i in s.edited | s.live_units:
        u = s.layout.units[i]
        opt = optimizers[u.optimizer_index] if u.optimizer_index < len(optimizers) else None
        state = opt.get("state", {}).get(u.param_index) if isinstance(opt, dict) else None
        taken = [(u.param_entry, model.get(u.param_entry.key[len("model."):])
                  if isinstance(model, dict) and u.param_entry.key.startswith("model.") else None)]
        taken += [(e, state.get(name) if isinstance(state, dict) else None)
                  for name, e in u.state_entries.items()]
        for e, t in taken:
            view = s.views.get(e.key)
            if isinstance(t, torch.Tensor) and view is not None and t.numel() == view.numel():
                view.copy_(t.reshape(view.shape))


class Pipeline:
    """Replays and persists saves off the training thread.

    Args:
        config: the engine's options (``max_inflight`` persist threads at ``io_nice``, at most
            :func:`gockpt.persist.io_threads_cap` io threads each, storage options).
        optimizers: the engine's optimizers (their number is recorded in the manifest).
        backends: the replay backend of each optimizer.
        slots: the host slot pool; a save's hold of its slot is released once it is durable or
            failed (the slot goes back with the last save sharing it).
        on_durable: called with the metrics of each published save, on the persisting thread.
    """

    def __init__(self, config: GoCkptConfig, optimizers: list[Optimizer], backends: ReplayBackends,
                 slots: SlotPool, on_durable: Callable[[CheckpointMetrics], None]) -> None:
        self._config = config
        self._optimizers = optimizers
        self._backends = backends
        self._slots = slots
        self._on_durable = on_durable
        self._errors: list[tuple[BaseException, SaveHandle]] = []
        self._lock = threading.Lock()
        self._publish_lock = threading.Lock()
        self._published_seq: dict[str, int] = {}
        # The persist and io threads run at ``io_nice``; copy and replay do not: the training
        # thread waits for them at window ends and for the gradient buffers.
        self._persist_pool = ThreadPoolExecutor(
            config.max_inflight, thread_name_prefix="gockpt-persist",
            initializer=lower_thread_priority, initargs=(config.io_nice,))
        # (state bytes, seconds) of the latest replays, for the planner's replay rate.
        self._replay_samples: collections.deque[tuple[int, float]] = collections.deque(maxlen=32)
        self._queued_replay_bytes = 0  # under _samples_lock: replays queued, not yet done
        self._samples_lock = threading.Lock()
        self._replay_q: queue.Queue = queue.Queue()
        # A gradient copy was torn by an in-place write (zero_grad(set_to_none=False) on the
        # model, p.grad.zero_()): set by the replay thread, read by Engine.save.
        self.grads_written = False
        self._replay_thread = threading.Thread(target=self._replay_loop, name="gockpt-replay", daemon=True)
        self._replay_thread.start()

    # ------------------------------------------------------------------ training thread

    def submit_replay(self, s: SaveRecord, record: ReplayRecord, ticket: CopyTicket) -> None:
        """Queue the replay of one update's gradients, copied by ``ticket``, onto ``s``."""
        nbytes = sum(s.layout.units[i].state_bytes for i in record[3])
        with self._samples_lock:
            self._queued_replay_bytes += nbytes
        self._replay_q.put(("replay", s, record, ticket, nbytes))

    def replay_backlog_bytes(self) -> int:
        """State bytes of the replays queued and not yet done (their updates' units)."""
        with self._samples_lock:
            return self._queued_replay_bytes

    def replay_bytes_per_s(self) -> float:
        """State bytes the latest replays brought forward per second of replay (after their
        gradients arrived), over the last 32 replays. Before 5 ms of replay was timed, the
        replay self-check's pace on its timing probe (an idle core's: the waits it predicts
        are the least likely), or 0.0 where none was timed; with an emulated replay pace
        (``replay_bytes_per_s`` of the config), the lower of that and the probe's."""
        with self._samples_lock:  # appended on the replay thread
            samples = list(self._replay_samples)
        seconds = sum(t for _, t in samples)
        if seconds > 0.005:
            return sum(n for n, _ in samples) / seconds
        known = [x for x in (self._backends.probe_bytes_per_s(), self._config.replay_bytes_per_s)
                 if x]
        return min(known) if known else 0.0

    def finalize(self, s: SaveRecord) -> None:
        """Persist ``s`` in the background once the replays queued before it are done."""
        self._replay_q.put(("finalize", s))

    def raise_errors(self) -> None:
        """Raise the oldest background error not raised yet (the original exception); one its
        save's ``handle.result()`` already raised on the training thread is not raised again."""
        while self._errors:
            with self._lock:
                e, handle = self._errors.pop(0)
            if handle._error_raised:
                continue
            # The original exception, with its type and cause chain: ``except CheckpointTornError``
            # and friends must work on the training thread.
            raise e

    def close(self) -> None:
        """Stop the replay thread and wait for the persists in flight."""
        self._replay_q.put(("stop", None))
        self._replay_thread.join()
        self._persist_pool.shutdown(wait=True)

    # ------------------------------------------------------------------ background

    def _replay_loop(self) -> None:
        while True:
            item = self._replay_q.get()
            kind, s = item[0], item[1]
            if kind == "stop":
                return
            try:
                if kind == "replay":
                    self._replay(s, *item[2:])
                else:
                    if s is s.share.leader and s.failed is None:
                        _sync_edited(s)  # its replays are done: before any persist reads the slot
                    self._persist_pool.submit(self._persist_safely, s)
            except BaseException as e:  # noqa: BLE001 - reported through the handle
                # A gradient copy torn by the loop's own in-place write is not an engine fault:
                # the save is logged as overtaken, and later ones wait for their gradient copies.
                torn = kind == "replay" and isinstance(e, CheckpointTornError)
                if torn and not self.grads_written:
                    self.grads_written = True
                    log.warning("gockpt: gradients were written in place while being copied "
                                "(an in-place zero_grad or accumulation right after the "
                                "update); later checkpoints wait for their gradient copies "
                                "(mode 'gockpt' instead of 'gockpt_o')")
                # A failed replay spoils the snapshot of every save sharing it.
                for r in s.share.records if kind == "replay" else [s]:
                    if r.failed is None:
                        r.failed = e
                        r.overtaken = r.overtaken or torn
                    r.cancel.set()

    def _replay(self, s: SaveRecord, record: ReplayRecord, ticket: CopyTicket, nbytes: int) -> None:
        opt_index, cls, hparams, units, turn, found_inf = record
        try:
            if not s.share.alive():  # every save using this snapshot failed or was cancelled
                return
            ticket.wait()  # raises CheckpointTornError when a gradient changed during its copy
            if found_inf is not None and bool(found_inf.any()):
                return  # GradScaler skipped this update; the live state did not move either
            t0, replayed = perf_counter(), 0
            backend = self._backends.select(opt_index)
            s.metrics.replay_backend = backend.name
            by_group: dict[int, list[tuple[int, Unit]]] = {}
            for i in units:
                u = s.layout.units[i]
                by_group.setdefault(u.group_index, []).append((i, u))
            for gi, members in by_group.items():
                be = backend
                if be.name != "torch" and not (
                    be.supports(cls, hparams[gi])
                    and all(u.param.dtype == torch.float32 for _, u in members)
                ):
                    be = TorchReplay()  # the self-check probed fp32 with group 0's flags
                grads = [s.grad_views[turn][i] for i, _ in members]
                params = [s.views[u.param_entry.key] for _, u in members]
                states = [{n: s.views[e.key] for n, e in u.state_entries.items()} for _, u in members]
                back = _in_live_order(members, params, grads, states)
                if back and be.name != "torch":
                    be = TorchReplay()  # the live strides, mixed per tensor: the live arithmetic
                replayed += sum(u.state_bytes for _, u in members)
                traced = sum(g.numel() * g.element_size() for g in grads) if _trace.active() else 0
                with _trace.phase("replay", traced):
                    be.step(cls, hparams[gi], params, grads, states)
                    for view, stepped in back:
                        view.copy_(stepped)
            pace = self._config.replay_bytes_per_s
            if pace is not None:  # an emulated slow replay (benchmarks): sleeps, off the GIL
                rest = replayed / pace - (perf_counter() - t0)
                if rest > 0:
                    time.sleep(rest)
            with self._samples_lock:
                self._replay_samples.append((replayed, perf_counter() - t0))
        finally:
            with self._samples_lock:
                self._queued_replay_bytes -= nbytes
            s.slot.grad_busy[turn].set()

    def _writer_parts(self, s: SaveRecord) -> tuple[Snapshot, dict]:
        """The save's snapshot as its writer sees it, and the request fields the writer sets."""
        writer = s.writer
        assert writer is not None
        ex = s.extra
        snap = Snapshot(path=s.path, model_state_dict=resolve(ex["model"], s.views, s.path),
                        optimizer_state_dicts=[resolve(o, s.views, s.path) for o in ex["optimizers"]],
                        extra=resolve(ex["user"], s.views, s.path), metrics=s.metrics,
                        staging=writer.staging)
        hooks: dict = {"files": dict(writer.files(snap)),
                       "before_publish": lambda _target: writer.before_publish(snap)}
        if writer.staging is not None or writer.framework_names is not None:
            def target(fs: Any, root: str, names: list[str], timeout_s: float | None) -> Any:
                if writer.staging is None and not fsutil.is_local(fs):
                    return open_target(fs, root, names, timeout_s)
                return LocalTarget(fs, root, writer.staging,
                                   framework_names=writer.framework_names)
            hooks["target_factory"] = target
        return snap, hooks

    def _persist_safely(self, s: SaveRecord) -> None:
        """:meth:`persist` on the persist pool, where an error escaping it would be lost in an
        unread future: its handle would never resolve and its slot never come back."""
        try:
            self.persist(s)
        except BaseException as e:  # noqa: BLE001 - an engine fault: fail this save, loudly
            log.exception("gockpt: %s: internal error while persisting", s.path)
            if s.lending is not None:
                self._slots.end_lending(s.slot, s.lending)
            self._release(s)
            if not s.handle.done():
                with self._lock:
                    self._errors.append((e, s.handle))
                s.handle._future.set_exception(e)
            s.phase = Phase.FAILED

    @staticmethod
    def _reusable(s: SaveRecord) -> dict[str, FileOrigin]:
        """Shard file name -> the published file of an earlier save that holds its bytes: the
        same header, and the slot held the very same entries (no byte copied again since) when
        that save and ``s`` were handed off (``frozen_copy="when_changed"``)."""
        out: dict[str, FileOrigin] = {}
        for i, entries in (s.held_entries or {}).items():
            got = s.slot.held.origins.get(i)
            if got is None:
                continue
            header, then, origin, _ = got
            if header == s.shards[i].header and len(then) == len(entries) and all(
                    a is b for a, b in zip(then, entries)):
                out[s.shards[i].file] = origin
        return out

    @staticmethod
    def _note_origins(s: SaveRecord, res: PersistResult) -> None:
        """Where ``s``'s shards of held entries now lie, for the next save into its slot."""
        origins = s.slot.held.origins
        for i, entries in (s.held_entries or {}).items():
            origin = res.origins.get(s.shards[i].file)
            known = origins.get(i)
            # The newest save's file: an older one (a borrowed slot) may publish after it.
            if origin is not None and (known is None or known[3] < s.seq):
                origins[i] = (s.shards[i].header, entries, origin, s.seq)

    def persist(self, s: SaveRecord) -> None:
        """Write ``s`` and resolve its handle (persist pool; the training thread in ``sync``)."""
        m = s.metrics
        s.drain()
        try:
            if s.failed is not None:
                raise s.failed
            if s.cancel.is_set():
                raise CheckpointCancelledError(f"{s.path}: cancelled")
            # A follower holds the leader's snapshot: the leader's flags tell whether it is torn.
            late = [*(s.late_edits or ()), *((s.leader.late_edits or ()) if s.leader is not None else ())]
            for flag, event in late:
                event.synchronize()  # type: ignore[attr-defined]
                if bool(flag):
                    s.overtaken = True
                    raise CheckpointTornError(edited_after_capture(s.path))
            m.device_wait_s = sum(t.device_wait_s() for t in s.tickets.values())
            meta = {
                "requested_step": m.requested_step,
                "captured_step": m.captured_step,
                "mode": m.mode,
                "num_overlap_steps": m.num_overlap_steps,
                "model_keys": s.layout.model_keys,
                "num_optimizers": len(self._optimizers),
                "replay": self._backends.info.get(0, {}),
                **({"writer": type(s.writer).__name__} if s.writer is not None else {}),
                "created_unix_s": time.time(),
                "run": s.run,
            }
            blob = io.BytesIO()
            with _trace.phase("serialize"):
                torch.save(_stored_record(s), blob)
            snap, hooks = self._writer_parts(s) if s.writer is not None else (None, {})
            req = PersistRequest(
                path=s.path, shards=s.shards, slot=s.slot.data, shard_bases=s.shard_bases,
                extra=blob.getvalue(), meta=meta,
                aliases=s.layout.aliases if s.shard_segments is None else {},
                shard_segments=s.shard_segments, **hooks,
                storage_options=self._config.storage_options,
                num_io_threads=min(self._config.num_io_threads, io_threads_cap()),
                chunk_bytes=self._config.chunk_bytes, update_latest=self._config.update_latest,
                cancel=s.cancel, publish_lock=self._publish_lock,
                storage_timeout_s=self._config.storage_timeout_s, io_nice=self._config.io_nice,
                direct_io=self._config.direct_io,
                origins_of=frozenset(s.shards[i].file for i in s.held_entries or {}),
                # The slot goes to the next save once its bytes are written, before the fsyncs
                # and the publish, unless the writer still reads the snapshot's tensors then.
                on_slot_read=(partial(self._release, s) if s.writer is None
                              or not s.writer.reads_tensors_at_publish else None),
                # Keyed by directory, not spelling: an older save of ``ckpt/last`` must not
                # publish over a newer one of ``./ckpt/last``.
                is_superseded=lambda: self._published_seq.get(s.path, -1) > s.seq,
                on_published=lambda: self._published_seq.__setitem__(s.path, s.seq),
            )
            # The next save may borrow the slot while this one writes it (one holder, GoCkpt's
            # own files only: a writer's files may share the slot's memory).
            if s.writer is None:
                # Set first: find_leader must see it as soon as a borrow is possible.
                s.lending = Drain(slot_chunks(req), threads=io_threads(req))
                req.on_chunk_read, req.on_chunk_linked = s.lending.read, s.lending.skip
                if not self._slots.make_lendable(s.slot, s.lending):
                    s.lending = None
                    req.on_chunk_read = req.on_chunk_linked = None
            req.reuse = self._reusable(s)
            res = persist(req)
            if res.published and s.held_entries:
                self._note_origins(s, res)
            if res.published and snap is not None:
                try:
                    s.writer.after_publish(snap)  # type: ignore[union-attr]
                except Exception:  # noqa: BLE001 - the checkpoint is durable: report, keep it
                    log.exception("gockpt: %s: the writer's after_publish failed", s.path)
            m.superseded = not res.published
            m.persist_bytes = res.bytes_written
            m.linked_bytes = res.bytes_linked
            m.persist_s = res.seconds
            m.persist_gbps = res.bytes_written / res.seconds / 1e9 if res.seconds > 0 else 0.0
            m.time_to_durable_s = perf_counter() - s.t_request
            m.host_peak_bytes = self._slots.peak_bytes
            if s is not s.share.leader:
                m.replay_backend = s.share.leader.metrics.replay_backend
        except BaseException as e:  # noqa: BLE001 - handed to the handle and the training thread
            if s.lending is not None:
                self._slots.end_lending(s.slot, s.lending)
            m.host_peak_bytes = self._slots.peak_bytes
            self._release(s)
            if s.overtaken:
                # Never a torn checkpoint, never a failed run: the previous checkpoints stand.
                log.warning("gockpt: %s", e)
                s.handle._overtaken = True
            elif not isinstance(e, CheckpointCancelledError) or s.failed is not None:
                # Told now; raised on the training thread at its next boundary (step_end, a
                # request, wait, close), never inside an update.
                log.error("gockpt: checkpoint %s failed: %s: %s", s.path, type(e).__name__, e)
                with self._lock:
                    self._errors.append((e, s.handle))
            s.handle._future.set_exception(e)
            # After the handle: until it resolves the save still counts as one in the pipeline.
            s.phase = Phase.FAILED
            return
        if s.lending is not None:
            self._slots.end_lending(s.slot, s.lending)
        self._release(s)
        if not m.superseded:
            self._on_durable(m)
        log.info("gockpt: %s durable (%s, K=%d, stall %.4fs)", s.path, m.mode, m.num_overlap_steps, m.stall_s)
        s.handle._future.set_result(m)
        s.phase = Phase.DONE


    def _release(self, s: SaveRecord) -> None:
        """Drop ``s``'s hold of its slot, once: early (``on_slot_read``) or at its end."""
        with self._lock:
            if s.slot_released:
                return
            s.slot_released = True
        self._slots.release(s.slot)


def _in_live_order(members: list[tuple[int, Unit]], params: list[torch.Tensor],
                   grads: list[torch.Tensor], states: list[dict[str, torch.Tensor]]
                   ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Where a unit's live parameter is in another memory order than its host views (which
    are contiguous: a ``channels_last`` conv weight), put copies in the live strides in place
    of its host views in ``params``, ``grads`` and ``states``, and return the (host view, copy)
    pairs to write back after the step. ATen steps a tensor in another order with other loops,
    which round bf16 and fp16 differently (measured: AdamW over a channels_last bf16 weight
    differs from the same over its contiguous copy), so the replay takes the live order. The
    gradient takes the parameter's strides (autograd's gradient layout contract for dense
    parameters); optimizer state is created in the parameter's format."""
    back = []
    for k, (_, u) in enumerate(members):
        live = u.param_entry.tensor
        if live.is_contiguous():
            continue
        stepped = _relaid(params[k], live)
        back.append((params[k], stepped))
        params[k] = stepped
        grads[k] = _relaid(grads[k], live)  # read only
        st = {}
        for name, view in states[k].items():
            like = u.state_entries[name].tensor
            if like.dim() and not like.is_contiguous():
                st[name] = _relaid(view, like)
                back.append((view, st[name]))
            else:
                st[name] = view
        states[k] = st
    return back


def _relaid(view: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """A copy of ``view`` (contiguous, on the host) in ``like``'s strides."""
    out = torch.empty_strided(tuple(like.shape), like.stride(), dtype=view.dtype)
    out.copy_(view)
    return out


def _stored_record(s: SaveRecord) -> dict:
    """The save's state trees as they go into its files.

    A writer that names its own tensor files may leave tracked tensors out (a weights-only
    save keeps the optimizer state for replay but writes none of it). The record then drops the
    optimizers whose state is not all stored under its own key, so it never names a tensor the
    checkpoint does not hold.
    """
    if s.shard_segments is None:  # GoCkpt's own shards hold every tracked tensor
        return s.extra
    stored = {name for shard in s.shards for name in shard.offsets}
    if all(references(o) <= stored for o in s.extra["optimizers"]):
        return s.extra
    return {**s.extra, "optimizers": []}
