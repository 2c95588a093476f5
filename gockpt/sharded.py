"""Sharded checkpoints: one engine per rank over its local shards, committed together (issue 13).

Under FSDP2 (``torch.distributed.fsdp.fully_shard``: ``DTensor`` parameters and optimizer state)
every rank runs a :class:`ShardedEngine`. Its :class:`gockpt.Engine` copies, and in the
multi-step modes replays, only the rank's local shards (``DTensor.to_local()``; GoCkpt §4.2-§4.3
per rank: the elementwise optimizers replay exactly on a shard, and gradient clipping is already
applied when the step post-hook sees the gradients). An optimizer that is not elementwise on a
shard makes the save ``lazy``, with a warning.

Under DDP (``replicated=True``: plain tensors, the same on every rank) the ranks share the
write instead: each rank's engine tracks a distinct share of the units, balanced by bytes
(:mod:`gockpt.partition`), and stores it whole (offsets 0); rank 0 also stores the buffers.
The parts are committed exactly as below. That holds only while the replicas are the same: a
save is refused on every rank (:class:`ReplicasDifferError`) when they may differ.

Layout of a sharded checkpoint ``<path>``::

    manifest.json     the global manifest, written last: meta.sharded = {world_size, parts}
    sharded.json      the index: captured step, world size, whether the parts are shares of a
                      replicated state (``replicated``), each part's manifest checksum
    rank-00000/       rank 0's part: a complete GoCkpt checkpoint of its local shards
                      (manifest.json, shard-*.safetensors, its non-tensor state)
    rank-00000.sharding.json   per tensor of that part: its DCP key, dtype, global shape,
                      offsets, placements, mesh shape and replica number
    rank-00001/, rank-00001.sharding.json, ...

Two-phase commit (PCcheck §4.1 across ranks). Every call is collective over ``group`` (gloo):

1. (every rank, training thread, :meth:`ShardedEngine.save`) rank 0 makes the staging directory
   beside ``path`` and broadcasts its name; inside ``Engine.save`` the ranks agree on one plan
   (mode and K: gathered, rank 0's multi-step mode with the smallest K, ``async`` if any rank
   must copy at once, ``lazy`` if any rank cannot replay); then they all-gather the requested
   and captured steps and abort the save unless every rank holds the same.
2. (every rank, engine threads) each rank's engine writes its part to ``<staging>/rank-<r>``:
   files fsynced, the part's manifest last, an atomic rename inside the staging directory. When
   the part's handle resolves, the rank writes ``rank-<r>.done`` (or ``rank-<r>.failed``).
3. (rank 0, commit thread) waits at most ``commit_timeout_s`` for every ``.done`` marker, checks
   each part's manifest (complete, at the agreed captured step), writes ``sharded.json`` and the
   global manifest, fsyncs, renames the staging directory to ``path`` (atomic, GoCkpt's local
   target) and moves ``latest``. A failed or missing part (a crashed rank) leaves no complete
   checkpoint: the staging directory is removed and the previous checkpoint stays the latest.

Loading, with any number of ranks, goes through ``torch.distributed.checkpoint``: see
:mod:`gockpt.dcp`. Sharded checkpoints are local (or shared-filesystem) paths only.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import numbers
import os
import threading
import uuid
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import Optimizer

from . import fsutil, storage
from ._sharded_commit import (
    INDEX_FILE,
    PartOvertakenError,
    mark,
    mark_captured,
    part_name,
    replicas_differ,
    sharding_name,
    write_atomic,
    xxh3,
)
from ._sharded_commit import (
    commit as commit_parts,
)
from .config import GoCkptConfig
from ._record import moved_since_pinned
from .engine import Engine
from .format import plan_shards
from .handle import CheckpointMetrics, SaveHandle
from .layout import StateLayout
from .partition import Partition, partition_layout
from .plan import CopyPlan
from .writer import CheckpointWriter, Snapshot, TensorFile

__all__ = ["INDEX_FILE", "ReplicasDifferError", "ShardedEngine", "ShardedHandle", "part_name", "sharding_name"]


def _plain(value: Any) -> Any:
    """A hyperparameter as values every rank can compare exactly: a tensor by dtype, shape and
    elements (not its device, nor its printed digits), numbers by ``repr`` (exact for floats),
    containers item by item, any other object by its type alone (its ``repr`` may show its
    address)."""
    if isinstance(value, torch.Tensor):
        return ("tensor", str(value.dtype), tuple(value.shape), value.detach().cpu().reshape(-1).tolist())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, numbers.Number):  # numpy scalars ...
        return repr(value)
    if isinstance(value, (tuple, list)):
        return tuple(_plain(v) for v in value)
    if isinstance(value, (set, frozenset)):
        return tuple(sorted(repr(_plain(v)) for v in value))
    if isinstance(value, dict):
        return tuple(sorted((str(k), _plain(v)) for k, v in value.items()))
    return type(value).__qualname__


class ReplicasDifferError(RuntimeError):
    """``replicated=True``: the ranks' copies of the state may differ, so shares taken from
    them would not make one state. Raised by :meth:`ShardedEngine.save` on every rank, before
    anything is written, when a parameter that did not require gradients when the engine was
    built does now (DDP, wrapped before, does not average its gradients: an unfreeze, a
    parameter group added), or the optimizers' hyperparameters differ between ranks (a
    schedule stepped on a metric of each rank's own). A framework then writes from one rank,
    as stock DDP writes rank 0's copy."""

log = logging.getLogger("gockpt")

def dcp_keys(layout: StateLayout) -> dict[str, str]:
    """Layout key -> the key ``torch.distributed.checkpoint`` flattens the same tensor to.

    ``model.<fqn>`` stays; ``optim.<i>.<param index>.<name>`` becomes ``optim.state.<fqn>.<name>``
    (DCP's ``get_optimizer_state_dict`` names state by parameter FQN); state of a parameter
    outside the model keeps its layout key.
    """
    out = {}
    for u in layout.units:
        out[u.param_entry.key] = u.param_entry.key
        fqn = u.param_entry.key[len("model."):] if u.param_entry.key.startswith("model.") else None
        for name, e in u.state_entries.items():
            out[e.key] = f"optim.state.{fqn}.{name}" if fqn is not None else e.key
    for e in layout.static:
        out[e.key] = e.key
    return out


class _PartWriter(CheckpointWriter):
    """GoCkpt's own shards for one rank's part; notes the part's sharding (``tensor_files``)."""

    claim_directory = False

    @property
    def reads_tensors_at_publish(self) -> bool:  # type: ignore[override]
        return self.user is not None and self.user.reads_tensors_at_publish

    def __init__(self, rank: int, world: int, user: CheckpointWriter | None, *,
                 store: Callable[[str], bool] | None = None, max_shard_bytes: int = 1 << 30) -> None:
        self.rank, self.world, self.user = rank, world, user
        self.store, self.max_shard_bytes = store, max_shard_bytes
        self.sharding: bytes = b""
        self.partition: Partition | None = None  # this save's share of a replicated state

    def tensor_files(self, layout: StateLayout) -> list[TensorFile] | None:
        # Called by Engine.save with the save's own layout, before any capture: the share a
        # part_state_fn is given is the one this part stores, even if a later save re-partitions.
        self.partition = layout.partition
        keys = dcp_keys(layout)
        kept = [e for e in layout.entries if self.store is None or self.store(e.key)]
        tensors = {}
        for e in kept:
            sh = e.shard
            tensors[e.key] = {
                "fqn": keys[e.key],
                "dtype": str(e.spec.dtype).removeprefix("torch."),
                "global_shape": list(sh.global_shape if sh else e.spec.shape),
                "offsets": list(sh.offsets if sh else (0,) * len(e.spec.shape)),
                "placements": list(sh.placements) if sh else None,
                "mesh_shape": list(sh.mesh_shape) if sh else None,
                # A plain tensor is the same on every rank (data parallel): rank 0's copy is
                # read, or the one copy of a shared write (each unit stored by its owner).
                "replica": sh.replica if sh else 0 if layout.partition is not None else self.rank,
            }
        aliases = {a: keys.get(t, t) for a, t in layout.aliases.items() if t in tensors}
        self.sharding = json.dumps({"format": "gockpt-sharding", "rank": self.rank,
                                    "world_size": self.world, "tensors": tensors,
                                    "aliases": aliases}, sort_keys=True).encode()
        if self.user is not None and self.user.tensor_files(layout) is not None:
            raise ValueError("a sharded save keeps GoCkpt's shards: the writer must not name tensor files")
        if self.store is None:
            return None
        # The tensors left out are still copied (and replayed: a multi-step capture needs the
        # optimizer state), just not written. File names unique to this save, as GoCkpt's own.
        shards = plan_shards([e.spec for e in kept], self.max_shard_bytes, f"shard-{uuid.uuid4().hex[:8]}")
        return [TensorFile(sh.file, [(k, k) for k in sh.offsets]) for sh in shards]

    def bind(self, fn: Callable[[Partition | None], Any]) -> Callable[[], Any]:
        """A ``state_fn`` calling ``fn`` with this save's partition (set by :meth:`tensor_files`)."""
        return lambda: fn(self.partition)

    def files(self, snapshot: Snapshot) -> Mapping[str, bytes]:
        return dict(self.user.files(snapshot)) if self.user is not None else {}

    def before_publish(self, snapshot: Snapshot) -> None:
        if self.user is not None:
            self.user.before_publish(snapshot)


class ShardedHandle:
    """One sharded save as seen by this rank, with :class:`gockpt.SaveHandle`'s interface.

    Attributes:
        path: the checkpoint directory.
        part: the handle of this rank's part (its own engine's save).
        metrics: the part's live metrics (``requested_step``, ``captured_step`` ...).
    """

    def __init__(self, path: str, part: SaveHandle, commit: Future[CheckpointMetrics] | None,
                 stage: str | None = None) -> None:
        self.path, self.part, self._commit = path, part, commit
        self.metrics = part.metrics
        self._stage = stage  # where its captured marker goes (None: none)

    @property
    def skipped(self) -> bool:
        return self.part.skipped

    @property
    def overtaken(self) -> bool:
        """This rank's part, or on rank 0 another rank's, ended unwritten with a warning
        (:attr:`gockpt.SaveHandle.overtaken`): the checkpoint is not committed, the ones before
        it stand, and the run goes on."""
        if self.part.overtaken:
            return True
        c = self._commit
        return c is not None and c.done() and isinstance(c.exception(), PartOvertakenError)

    @property
    def requested_step(self) -> int:
        """Optimizer updates applied when the checkpoint was requested."""
        return self.part.requested_step

    @property
    def captured_step(self) -> int | None:
        """The step whose state the checkpoint holds, once taken."""
        return self.part.captured_step

    def done(self) -> bool:
        """Whether this rank's part has ended (rank 0: and the commit)."""
        return self.part.done() and (self._commit is None or self._commit.done())

    def add_done_callback(self, fn: Callable[[ShardedHandle], None]) -> None:
        """Call ``fn(handle)`` once :meth:`done` (rank 0: once committed or failed), on the thread
        that finishes it; at once if already done."""
        if self._commit is None:
            self.part.add_done_callback(lambda _h: fn(self))
        else:
            self._commit.add_done_callback(lambda _f: fn(self))

    def result(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """This rank's part's metrics once durable; on rank 0 once the checkpoint is committed.

        Raises:
            The part's error; on rank 0 also the commit's (a failed or missing part:
            ``RuntimeError``, ``TimeoutError`` after ``commit_timeout_s``).
        """
        m = self.part.result(timeout_s)
        return m if self._commit is None else self._commit.result(timeout_s)

    def outcome(self, timeout_s: float | None = None) -> CheckpointMetrics:
        """As :meth:`result`, leaving the part's error to be raised by its engine
        (:meth:`gockpt.SaveHandle.outcome`)."""
        m = self.part.outcome(timeout_s)
        return m if self._commit is None else self._commit.result(timeout_s)


class ShardedEngine:
    """A :class:`gockpt.Engine` over this rank's local shards, committing saves with all ranks.

    Args:
        model: this rank's (``fully_shard``-ed) model.
        optimizers: its optimizer(s).
        config: engine options (``update_latest`` is applied by rank 0's commit only).
        group: the process group of the ranks saving together (None: the default group). The
            engine makes a gloo group over the same ranks for its own collectives.
        commit_timeout_s: seconds rank 0 waits for the other parts once its own is durable,
            and the timeout of the engine's collectives.
        replicated: the state is replicated (DDP: plain tensors, the same on every rank): each
            rank stores a distinct share of the units, balanced by bytes
            (:func:`gockpt.partition.partition_layout`), so each rank copies, replays and writes
            about 1/N of the state; rank 0 also stores the buffers. A
            ``DistributedDataParallel`` wrapper is unwrapped (its ``module`` is checkpointed,
            under the keys DCP uses). A save of a model holding ``DTensor`` shards raises
            ValueError.
        synced: replicated: the parameters whose gradients are averaged across the ranks (DDP's:
            those requiring gradients when it wrapped the model); None: those requiring them
            when the engine is built. A save while another one requires gradients raises
            :class:`ReplicasDifferError`.
        **engine_kwargs: passed to :class:`gockpt.Engine` (``start_step``, ...).

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, model: nn.Module, optimizers: Optimizer | Sequence[Optimizer],
                 config: GoCkptConfig | None = None, *, group: Any = None,
                 commit_timeout_s: float = 300.0, replicated: bool = False,
                 synced: Iterable[nn.Parameter] | None = None, **engine_kwargs: Any) -> None:
        if not dist.is_initialized():
            raise RuntimeError("ShardedEngine needs torch.distributed initialized (init_process_group)")
        if replicated and isinstance(model, nn.parallel.DistributedDataParallel):
            model = model.module
        self.config = config or GoCkptConfig()
        self.commit_timeout_s = commit_timeout_s
        ranks = dist.get_process_group_ranks(group or dist.group.WORLD)
        self._group = dist.new_group(ranks, backend="gloo", timeout=timedelta(seconds=commit_timeout_s))
        self.rank, self.world = dist.get_rank(self._group), dist.get_world_size(self._group)
        self.engine = Engine(model, optimizers, dataclasses.replace(self.config, update_latest=False),
                             **engine_kwargs)
        self.engine._planner.agree = self._agree
        self.engine._planner.agree_flush = self._agree_flush
        self.replicated = replicated
        self._layout_digest: str | None = None  # replicated: what each rank partitions
        # Replicated: the parameters DDP (wrapped before this engine) averages the gradients of.
        if synced is None:
            synced = [p for p in model.parameters() if p.requires_grad] if replicated else []
        self._synced = {id(p) for p in synced}
        if replicated:
            self.engine._planner.select = self._partition
        self._commits = ThreadPoolExecutor(1, thread_name_prefix="gockpt-commit") if self.rank == 0 else None
        self._abandoned = threading.Event()  # close(collective=False): see commit's ``abandoned``
        self._handles: list[ShardedHandle] = []
        self._staging = storage.ClaimedStaging(self.config.storage_options, self.config.storage_timeout_s)

    # ------------------------------------------------------------------ public API

    @property
    def version(self) -> int:
        """Optimizer updates applied (the engine's step)."""
        return self.engine.version

    @property
    def optimizers(self) -> list[Optimizer]:
        """The optimizers the engine tracks (:attr:`gockpt.Engine.optimizers`)."""
        return self.engine.optimizers

    def abandon_uncaptured(self, reason: str) -> int:
        """:meth:`gockpt.Engine.abandon_uncaptured` on this rank's parts (not collective: call on
        every rank alike). A part failed so fails its checkpoint, which is not committed."""
        return self.engine.abandon_uncaptured(reason)

    def step_end(self) -> None:
        """:meth:`gockpt.Engine.step_end`, except that a background error of this rank's part is
        not raised here, where this rank alone would stop and leave the others in their next
        collective (a gloo "connection closed by peer" rather than the error): it is raised on
        every rank alike, naming the rank, at the next :meth:`save`, :meth:`wait` or
        :meth:`close`. The checkpoint it failed is not committed meanwhile."""
        self.engine._step_end(raise_errors=False)  # noqa: SLF001
        self._note_captured()

    def before_update(self) -> None:
        """:meth:`gockpt.Engine.before_update`."""
        self.engine.before_update()
        self._note_captured()

    def flush(self) -> None:
        """:meth:`gockpt.Engine.flush` (this rank's copy windows; not collective). A background
        error is raised at the next :meth:`save`, :meth:`wait` or :meth:`close`, as for
        :meth:`step_end`."""
        self.engine._flush(raise_errors=False)  # noqa: SLF001
        self._note_captured()

    def _note_captured(self) -> None:
        """Mark the parts captured since the last call (:func:`gockpt._sharded_commit.mark_captured`)
        that did not mark themselves at their capture (:meth:`_marking_view`: not replicated)."""
        for h in self._handles:
            if h._stage is not None and h.part.captured_step is not None:
                # A part already ended needs no marker (it tells a commit still waiting for the
                # part that it will come), and one written now could land in the stage while
                # the commit publishes it.
                if not h.part.done() and \
                        not os.path.exists(os.path.join(h._stage, f"{part_name(self.rank)}.captured")):
                    mark_captured(h._stage, self.rank)
                h._stage = None

    def _flush_and_note(self) -> None:
        try:
            # A background error stays for the engine's close to raise (raise_errors would
            # hand it over once, here, where it would be dropped).
            self.engine._flush(raise_errors=False)  # noqa: SLF001
        except Exception:  # noqa: BLE001 - a capture's own error: its save reports it
            return
        self._note_captured()

    def save(self, path: str, *, state_fn: Callable[[], Any] | None = None,
             mode: str | None = None, max_overlap_steps: int | None = None,
             writer: CheckpointWriter | None = None,
             part_state_fn: Callable[[Partition | None], Any] | None = None,
             store: Callable[[str], bool] | None = None) -> ShardedHandle:
        """Request a sharded checkpoint at ``path`` (a local directory); collective.

        Call on every rank at the same step boundary. Arguments as :meth:`gockpt.Engine.save`
        (``state_fn`` is called on every rank, its result stored in the rank's part; ``writer``
        may add files to each rank's part and veto it in ``before_publish``).

        Args:
            part_state_fn: instead of ``state_fn``: called at the captured step with the
                :class:`gockpt.partition.Partition` this rank's part stores (None unless
                ``replicated``), so that the rank keeps only its share of a state tree that
                names the live tensors (:func:`gockpt.partition.prune_model`); a tensor of the
                tree that this rank does not store is otherwise copied into its part.
            store: which of the rank's tracked tensors its part writes, by layout key
                (``model.<name>``, ``optim.<i>.<param index>.<name>``); None: all. The others
                are still copied and replayed but not written (a weights-only checkpoint:
                ``lambda key: key.startswith("model.")``); the state tree must not name them.

        Returns:
            A :class:`ShardedHandle` (skipped on every rank when any rank had no free slot).

        Raises:
            RuntimeError: the ranks disagree on the captured step, or the request failed on a
                rank (every rank raises; nothing is written), e.g. ``path`` is a directory that
                is not a checkpoint (rank 0 raises the ``FileExistsError`` itself); the engine
                is closed.
            ValueError: ``path`` is not local; both ``state_fn`` and ``part_state_fn`` given;
                the ranks gave different paths (every rank raises; nothing is written).
        """
        if self._group is None:
            raise RuntimeError("ShardedEngine is closed")
        if state_fn is not None and part_state_fn is not None:
            raise ValueError("pass state_fn or part_state_fn, not both")
        path = path.rstrip("/") or path
        fs, root = fsutil.url_to_fs(path, self.config.storage_options)
        if not fsutil.is_local(fs):
            raise ValueError(f"sharded checkpoints are written to local paths only, got {path}")
        framework_names = getattr(writer, "framework_names", None)
        stage, problem, view = None, None, None
        try:
            # A background error of an earlier save is raised here, on every rank alike.
            self.engine._pipeline.raise_errors()  # noqa: SLF001
            view = self._replica_view()
            if self.rank == 0:
                # At the request, on every rank alike: never replace someone's directory.
                storage.check_save_path(fsutil.path_key(root), update_latest=self.config.update_latest,
                                        framework_names=framework_names)
                stage = self._staging.make(root)
        except BaseException as e:  # noqa: BLE001 - every rank must reach the gather below
            problem = e
        try:
            key = fsutil.path_key(root)
        except (OSError, ValueError):
            key = root
        ready: list[Any] = [None] * self.world
        dist.all_gather_object(ready, (stage, None if problem is None else f"{type(problem).__name__}: {problem}",
                                       view, key), group=self._group)
        if any(err is not None for _, err, _, _ in ready):
            if stage is not None:
                fsutil.remove_local(stage)
            if problem is not None:
                raise problem
            raise RuntimeError("gockpt: sharded checkpoint not taken: " + "; ".join(
                f"rank {r}: {err}" for r, (_, err, _, _) in enumerate(ready) if err is not None))
        if len({k for _, _, _, k in ready}) > 1:
            # Each part would land in rank 0's directory while its rank's handle named another.
            if stage is not None:
                fsutil.remove_local(stage)
            raise ValueError("gockpt: sharded checkpoint not taken: the ranks asked for different "
                             "paths (every rank must save the same checkpoint): " + "; ".join(
                                 f"rank {r}: {k}" for r, (_, _, _, k) in enumerate(ready)))
        differ = replicas_differ([view for _, _, view, _ in ready])
        if differ is not None:
            if stage is not None:
                fsutil.remove_local(stage)
            raise ReplicasDifferError(f"gockpt: sharded checkpoint {path} not taken: {differ}")
        stage = ready[0][0]
        part_path = os.path.join(stage, part_name(self.rank))
        handle, error = None, None
        mine: tuple[Any, ...]
        try:
            part_writer = _PartWriter(self.rank, self.world, writer, store=store,
                                      max_shard_bytes=self.config.max_shard_bytes)
            fn = state_fn if part_state_fn is None else part_writer.bind(part_state_fn)
            if self.replicated:
                fn = self._marking_view(fn if fn is not None else lambda: None, stage)
            handle = self.engine.save(part_path, state_fn=fn, mode=mode,
                                      max_overlap_steps=max_overlap_steps, writer=part_writer)
            if not handle.skipped:
                write_atomic(os.path.join(stage, sharding_name(self.rank)), part_writer.sharding)
            m = handle.metrics
            mine = (m.requested_step, m.requested_step + m.num_overlap_steps - 1, handle.skipped, None)
        except BaseException as e:  # noqa: BLE001 - every rank must reach the gather below
            error = e
            mine = (None, None, False, f"{type(e).__name__}: {e}")
        views: list[Any] = [None] * self.world
        dist.all_gather_object(views, mine, group=self._group)
        failed = [f"rank {r}: {v[3]}" for r, v in enumerate(views) if v[3] is not None]
        steps = {(v[0], v[1]) for v in views if v[3] is None}
        skipped = {v[2] for v in views}
        if failed or len(steps) != 1 or len(skipped) != 1:
            if handle is not None and not handle.skipped:
                self.engine.remove(part_path)
            dist.barrier(group=self._group)
            if self.rank == 0:
                fsutil.remove_local(stage)
            if error is not None:
                raise error
            why = "; ".join(failed) or f"the ranks disagree (requested, captured, skipped): {views}"
            raise RuntimeError(f"gockpt: sharded checkpoint {path} not taken: {why}")
        assert handle is not None
        if handle.skipped:
            if self.rank == 0:
                fsutil.remove_local(stage)
            return ShardedHandle(path, handle, None)
        target = views[0][1]
        handle.add_done_callback(lambda h: mark(stage, self.rank, h))
        commit = None
        if self._commits is not None:
            # The run it records: this engine's in the checkpoint's directory (its part's is
            # the staging directory's).
            run = self.engine.run_for(os.path.dirname(root.rstrip("/")) or "/")
            commit = self._commits.submit(commit_parts, path, stage, target, handle, world=self.world,
                                          config=self.config, timeout_s=self.commit_timeout_s,
                                          replicated=self.replicated, run=run,
                                          framework_names=framework_names,
                                          abandoned=self._abandoned.is_set)
        sh = ShardedHandle(path, handle, commit, stage)
        self._handles = [h for h in self._handles if not h.done()] + [sh]
        self._note_captured()
        return sh

    def wait(self, timeout_s: float | None = None) -> list[CheckpointMetrics]:
        """Finish every pending save on every rank; collective.

        Returns:
            Metrics of the saves finished (on rank 0: committed).

        Raises:
            RuntimeError: on every rank, when a save failed on any rank (the message names it).
        """
        if self._group is None:
            return []  # closed: close() finished every save, and the group is gone
        out, error = [], None
        try:
            self.engine.wait(timeout_s)
            self._note_captured()  # the captures of this wait, before their handles are let go
            for h in self._handles:
                try:
                    out.append(h.result(timeout_s))
                except BaseException:
                    # A part that ended unwritten with a warning fails its checkpoint, not the
                    # run; rank 0's commit ends with the part's error.
                    if h._commit is not None:  # noqa: SLF001 - this module's handle
                        h._commit.exception(timeout_s)  # noqa: SLF001 - ended, whatever its outcome
                    if not h.overtaken:
                        raise
        except BaseException as e:  # noqa: BLE001 - raised on every rank, below
            error = e
        self._handles = [h for h in self._handles if not h.done()]
        errors: list[Any] = [None] * self.world
        dist.all_gather_object(errors, None if error is None else f"{type(error).__name__}: {error}",
                               group=self._group)
        bad = [f"rank {r}: {e}" for r, e in enumerate(errors) if e is not None]
        if error is not None:
            raise error
        if bad:
            raise RuntimeError("gockpt: a sharded checkpoint failed on another rank: " + "; ".join(bad))
        return out

    def close(self, *, collective: bool = True) -> None:
        """:meth:`wait`, then close the engine and release the directory claims; collective.

        Args:
            collective: False once the ranks no longer meet (a rank failed): skip the
                collective wait; this rank's own saves are still finished, and rank 0 commits
                one in flight only if every part arrives, waiting for a missing one only while
                its rank's files keep growing (``gockpt._sharded_commit.ABANDON_IDLE_S``).

        A second call does nothing (the engine's group is gone after the first).
        """
        if self._group is None:
            return
        if not collective:
            self._abandoned.set()
        with contextlib.ExitStack() as stack:  # each runs, last first, whatever raised before
            # Last, even when something before it raised: a second close must not meet the
            # other ranks again (they have destroyed their groups).
            stack.callback(self._destroy_group)
            stack.callback(self._staging.release)
            if self._commits is not None:
                stack.callback(self._commits.shutdown, wait=True)
            stack.callback(self.engine.close)
            if collective:
                self.wait()
            else:
                self._flush_and_note()  # before the engine's close waits for the replay and persist

    def _destroy_group(self) -> None:
        """Destroy the engine's own gloo group (local, not collective). Left to the
        interpreter's teardown, its worker threads are torn down in no set order, and a spawned
        rank has been seen aborting at exit ("terminate called without an active exception")."""
        group, self._group = self._group, None
        if group is None or not dist.is_initialized():
            return  # closed before, or gone with the default group
        try:
            dist.destroy_process_group(group)
        except ValueError:
            pass  # already destroyed by the caller

    # ------------------------------------------------------------------ agreement and commit

    def _marking_view(self, fn: Callable[[], Any], stage: str) -> Callable[[], Any]:
        """``fn`` as the part's ``state_fn``: at the captured step (whatever path captures it: a
        step boundary, a flush, ``wait``) it also writes this rank's ``captured`` marker with its
        replica view then, which the commit compares across the parts."""
        def call() -> Any:
            out = fn()
            mark_captured(stage, self.rank, self._replica_view())
            return out
        return call

    def _replica_view(self) -> tuple[list[str], list[str], str] | None:
        """Replicated: (names of the parameters requiring gradients that did not when the engine
        was built, names of the parameters DDP leaves out (``_ddp_params_and_buffers_to_ignore``:
        never broadcast nor averaged, each rank holds its own), a digest of the optimizers'
        hyperparameters); None otherwise."""
        if not self.replicated:
            return None
        eng = self.engine
        ignored = set(getattr(eng.model, "_ddp_params_and_buffers_to_ignore", ()) or ())
        named = list(eng.model.named_parameters())
        unsynced = [n for n, p in named if p.requires_grad and id(p) not in self._synced and n not in ignored]
        hyper = [[{k: _plain(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
                 for o in eng.optimizers]
        return unsynced, [n for n, _ in named if n in ignored], xxh3(repr(hyper).encode())

    def _partition(self, layout: StateLayout) -> StateLayout:
        """This rank's share of the replicated ``layout`` (training thread, at a save)."""
        self._layout_digest = xxh3(repr([(e.key, str(e.spec.dtype), e.spec.shape)
                                          for e in layout.entries]).encode())
        return partition_layout(layout, self.rank, self.world)

    def _agree_flush(self, short: bool) -> bool:
        """Whether any rank finishes its saves in flight at this request for want of a host
        slot (``short``: this rank does; training thread, inside ``Engine.save``; collective).
        Every rank then does, at the same step: one rank finishing them alone captured its
        parts a step or more before the others', and those checkpoints were not committed."""
        flags: list[Any] = [None] * self.world
        dist.all_gather_object(flags, short, group=self._group)
        return any(flags)

    def _agree(self, plan: CopyPlan) -> tuple[str, int]:
        """The mode and K every rank follows, from this rank's ``plan`` (training thread, inside
        ``Engine.save``; collective): a one-step mode where any rank copies in one step, else the
        least K. The planner re-plans its blocks for them (:meth:`gockpt._planner.Planner.plan`).

        Raises:
            RuntimeError: replicated, and the ranks partitioned different states (every rank
                raises: the partition would not cover each tensor once).
        """
        eng = self.engine
        moved = moved_since_pinned(eng._all, eng.version, eng._planner.layout)  # noqa: SLF001
        views: list[Any] = [None] * self.world
        dist.all_gather_object(views, (plan.mode, plan.num_overlap_steps, self._layout_digest, moved),
                               group=self._group)
        if len({v[2] for v in views}) > 1:
            raise RuntimeError("gockpt: replicated=True needs the same parameters and optimizer "
                               "state on every rank; the ranks hold different tensors")
        if any(v[3] for v in views):
            # A save in flight pinned to this step no longer matches the state on some rank
            # (a rank sees only its own part: the buffers are rank 0's): that rank would
            # finish it now rather than share it, so every rank does, and all capture it at
            # the same step.
            eng._flush_windows()  # noqa: SLF001
        modes = [v[0] for v in views]
        if any(m in ("sync", "async") for m in modes):
            mode, k = ("sync" if "sync" in modes else "async"), 1
        elif "lazy" in modes:
            mode, k = "lazy", 1
        else:
            # A rank whose gradient copies were torn behind its loop plans gockpt: all do.
            mode, k = ("gockpt" if "gockpt" in modes else modes[0]), min(v[1] for v in views)
        return mode, k
