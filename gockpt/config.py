"""Engine configuration: one frozen, keyword-only dataclass."""

from __future__ import annotations

import dataclasses
import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

MODES = ("auto", "sync", "async", "lazy", "gockpt", "gockpt_o")
"""Checkpoint modes.

- ``sync``: blocking save (copy and persist on the training thread): the reference.
- ``async``: snapshot everything at the request, persist in the background (GoCkpt §2, "Async").
- ``lazy``: copy during the next forward/backward, wait only before the next update
  (DataStates-LLM §V-A2); the same as ``gockpt`` with K = 1.
- ``gockpt``: copy one block per step over K steps, copy the gradients of the blocks already
  copied while the training thread waits at the optimizer step, replay them on the CPU
  (GoCkpt §4.2, §4.3).
- ``gockpt_o``: as ``gockpt``, but the gradient copy overlaps the next forward (GoCkpt §4.2.4).
- ``auto``: the mode with the least predicted stall from measured costs (GoCkpt §4.2.3).
"""

WHEN_FULL = ("wait", "skip")
FROZEN_COPY = ("always", "when_changed")
REPLAY_BACKENDS = ("auto", "torch", "native")


@dataclass(frozen=True, kw_only=True)
class GoCkptConfig:
    """Options of :class:`gockpt.Engine`.

    Raises:
        ValueError: from ``__post_init__``, naming the field and its allowed range.
    """

    mode: str = "auto"
    """One of :data:`MODES`."""

    max_overlap_steps: int = 7
    """Upper bound on K, the number of training steps one checkpoint's copy may span
    (GoCkpt §4.2.3 caps it near 7: more steps add gradient copies and replay work). >= 1."""

    min_overlap_steps: int = 1
    """Lower bound on the K a multi-step plan chooses (1 <= min_overlap_steps <=
    max_overlap_steps); raise it to force a copy across several steps. The windows may still
    end sooner: at the next request when it comes before them (the two saves then share one
    snapshot), at the run's last step, or when a request finds every host slot taken; and
    ``auto`` compares that K with ``lazy`` (K = 1)."""

    window_quantile: float = 0.25
    """Which quantile of the latest ``window_memory`` copy windows (seconds from the end of one
    optimizer update to the start of the next) a plan sizes its blocks for, in [0, 1]
    (``ValueError`` otherwise). Each window's overhead sample is measured against the forecast
    of its own time, so while the forecast holds still the quantile cancels out of the plan; it
    matters when the forecast moves. After a stretch of slow steps the median rises with them,
    and a plan made then counts on room its earlier samples never saw: when the steps speed up
    again, its windows end with copy left to wait for. The 25th percentile rises later and less
    (measured side by side with the median in ``docs/benchmark.md``: fewer waits at window ends
    in 7 of 8 rounds). 0.5 is the median, the forecast before this option existed."""

    window_memory: int = 15
    """How many of the latest copy windows (one per training step) the forecast reads, >= 1
    (``ValueError`` otherwise). At quantile q the forecast rises only once more than 1 - q of
    them are longer, and falls once more than q of them are shorter: a longer memory rides out
    a longer stretch of slow steps, and follows a lasting change of the step time later."""

    host_buffer_bytes: int | None = None
    """Bytes of host memory (pinned on CUDA) for snapshot slots and their gradient buffers,
    allocated once and reused (a gradient buffer that two saves in a row did not need is
    freed). ``None``: one slot, about one checkpoint (plus the gradient buffers of its plan),
    whatever ``max_inflight`` is; a number: up to ``max_inflight`` slots
    within it. Must fit at least one checkpoint. Saves requested at one step share one slot
    (one host copy, each with its own files and state) when the first one's captured step is
    one the later request allows; a save needing a slot while none is free follows
    ``when_full``. :attr:`gockpt.Engine.peak_host_bytes` and
    :attr:`gockpt.CheckpointMetrics.host_peak_bytes` report the most held at once."""

    max_inflight: int = 2
    """Checkpoints that may be persisted at once (threads of the persist pool; more queue), and
    the most host snapshot slots when ``host_buffer_bytes`` is set (PCcheck §3.1). >= 1."""

    when_full: str = "wait"
    """What a request does when no snapshot slot is free and it cannot share one: ``"wait"``
    (counted as stall) or ``"skip"`` (the request is dropped and its handle says so; the
    first skip is logged as a warning on the ``gockpt`` logger, later ones at INFO)."""

    num_io_threads: int = 4
    """Threads writing shard files in parallel (GoCkpt §4.4.3). >= 1. The engine runs at most
    one per CPU core this process may use, less one for the training thread (at least 1)."""

    max_shard_bytes: int = 1 << 30
    """Upper bound on the tensor bytes of one shard file (a larger single tensor gets a
    shard of its own). >= 1."""

    chunk_bytes: int = 4 << 20
    """Granularity of D2H copies and file writes in bytes (GoCkpt §4.4.2: 4 MB): a larger
    tensor is copied in slices of this size, consecutive smaller ones together up to it (CPU
    path). >= 4096."""

    replay_backend: str = "auto"
    """CPU replay backend: ``"torch"`` (the optimizer's own torch implementation on CPU
    tensors), ``"native"`` (the compiled kernel in ``csrc/``), or ``"auto"`` (the fastest
    bit-exact one found by the start-up self-check)."""

    storage_options: Mapping[str, Any] = field(default_factory=dict)
    """Passed to ``fsspec.core.url_to_fs`` (credentials, endpoint of an S3 store, ...)."""

    verify_on_load: bool = True
    """Check every file's checksum when loading (sizes, file kinds and shard headers are
    checked regardless)."""

    update_latest: bool = True
    """Atomically point ``latest`` in a checkpoint's parent directory at it once it is
    complete (PCcheck §4.1)."""

    host_link_bytes_per_s: float | None = None
    """Emulated device-to-host bandwidth in bytes/s for benchmarks on machines without an
    accelerator: the copy worker sleeps so that a copy takes at least ``bytes / rate``.
    ``None``: no throttling."""

    replay_bytes_per_s: float | None = None
    """Emulated CPU replay pace in bytes of state (parameters and optimizer state replayed) per
    second, for benchmarks on machines without an accelerator, where the replay keeps up with
    steps of a second or so: the replay thread sleeps so that replaying one update takes at
    least ``bytes / rate``, as a replay slower than GPU steps would. ``None``: full speed."""

    storage_timeout_s: float | None = 60.0
    """Bound in seconds on one object-store operation, retries included: for ``s3://``, botocore
    connect/read timeouts of a third of it and 3 attempts (standard retry mode, which backs off
    on ``503 SlowDown``) unless ``storage_options["config_kwargs"]`` sets them; for other
    non-local filesystems, each call into the store (a piece write, the manifest put, the
    writer claim) is waited for at most this long. Past it the save
    fails with :class:`gockpt.CheckpointTimeoutError` and its partial objects are deleted.
    Local disks are not bounded (a write in progress cannot be interrupted). ``None``: the
    filesystem's own defaults (s3fs: up to 25 tries of 15 s reads). > 0 or None."""

    slot_wait_timeout_s: float | None = 60.0
    """Bound in seconds on how long a save request waits for a free host snapshot slot when
    ``when_full="wait"`` (a slot is freed once an earlier checkpoint's files are written, before
    their fsync and the publish, so a hung store would otherwise stall training). Past it the
    request is skipped with a warning (its handle reports ``skipped``) and training goes on.
    ``None``: wait without bound. > 0 or None."""

    direct_io: bool = True
    """Write local shard files with ``O_DIRECT`` from a small page-aligned bounce buffer per
    writing thread, around the page cache (falls back to buffered writes where a filesystem
    refuses it): the writing thread does not copy every byte into the cache, the kernel has no
    write-back to do at ``fsync``, and a checkpoint does not grow the cache by its size. False:
    buffered writes through the page cache. The files are the same either way."""

    io_nice: int | None = None
    """Niceness, 0..19, that the persist and file-writing threads add to the process's (capped
    at 19), so that the training thread wins the cores and the disk while a checkpoint is
    written. Linux only (elsewhere ignored): applied per thread with ``os.setpriority``, and
    Linux derives those threads' best-effort I/O priority from it (``ioprio_set(2)``; the BFQ
    scheduler honours it). The copy and replay threads keep the process's priority. A checkpoint
    stays exact, but on cores busy with other work a high value lengthens its time to durable
    and so the wait of a request for a free slot. ``None``: no change."""

    frozen_copy: str = "always"
    """Whether a frozen parameter (``requires_grad=False``, no optimizer state) that the reused
    host slot already holds from an earlier checkpoint is copied again: ``"always"``, or
    ``"when_changed"``: only while it changed, which removes most of each later checkpoint's
    device-to-host copy for a mostly frozen model (LoRA-style fine-tuning), and on a local
    filesystem most of its write (unchanged frozen shards are hard-linked from the checkpoint
    before). Opt-in, because a write that bypasses the tensor's version counter (through
    ``tensor.data``, a NumPy or DLPack alias, or its untyped storage) is not seen as a change.

    Unchanged means the same tensor at the same address with the same dtype, shape and strides,
    and a version counter that has not moved. Every in-place operation on a tensor or on a view
    of it (``copy_``, ``load_state_dict``, optimizer steps, ``torch.no_grad()`` edits) moves
    that counter. These writes do not: through ``tensor.data`` (``p.data.mul_(m)``, as some
    older EMA and momentum-encoder code does), through a NumPy array or DLPack capsule that
    shares the tensor's memory (``p.numpy()[:] = w``, ``np.add(..., out=p.numpy())``), and
    through ``p.untyped_storage()``. Leave ``"always"`` where frozen tensors are edited that
    way, or call ``p.copy_(...)`` instead: such an edit would be missing from the checkpoint,
    and from every later one until the tensor is edited in a way that is seen. Buffers are
    always copied: native kernels update some of them in place without moving their version
    counter (BatchNorm's running statistics). :attr:`gockpt.CheckpointMetrics.unchanged_bytes`
    reports the bytes not copied again.

    With ``"when_changed"`` frozen parameters are also stored in shard files of their own, and
    on a local filesystem a shard none of whose bytes was copied again since the checkpoint
    before is hard-linked from that checkpoint's file rather than written
    (:attr:`gockpt.CheckpointMetrics.linked_bytes`), if that file is still the one it published
    (same inode, size and modification time). Every checkpoint directory still holds all of
    its files: removing the one it links from leaves it whole. Checkpoints that link one file
    share its disk blocks: damage to that file (an in-place edit, a flipped bit on disk) reaches
    every one of them, which loading reports as a checksum error (``CheckpointCorruptError``).
    GoCkpt never edits a published file. Keep ``"always"`` where each checkpoint must be an
    independent copy. Saves through a :class:`gockpt.writer.CheckpointWriter` (Accelerate's
    folder layout, the sharded and replicated engines) write every file; they still skip the
    copy."""

    def __post_init__(self) -> None:
        self._check_types()
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.max_overlap_steps < 1:
            raise ValueError(f"max_overlap_steps must be >= 1, got {self.max_overlap_steps}")
        if not 1 <= self.min_overlap_steps <= self.max_overlap_steps:
            raise ValueError(
                f"min_overlap_steps must be in [1, max_overlap_steps={self.max_overlap_steps}], "
                f"got {self.min_overlap_steps}")
        if not 0.0 <= self.window_quantile <= 1.0:
            raise ValueError(f"window_quantile must be in [0, 1], got {self.window_quantile}")
        if self.window_memory < 1:
            raise ValueError(f"window_memory must be >= 1, got {self.window_memory}")
        if self.max_inflight < 1:
            raise ValueError(f"max_inflight must be >= 1, got {self.max_inflight}")
        if self.frozen_copy not in FROZEN_COPY:
            raise ValueError(f"frozen_copy must be one of {FROZEN_COPY}, got {self.frozen_copy!r}")
        if self.when_full not in WHEN_FULL:
            raise ValueError(f"when_full must be one of {WHEN_FULL}, got {self.when_full!r}")
        if self.num_io_threads < 1:
            raise ValueError(f"num_io_threads must be >= 1, got {self.num_io_threads}")
        if self.max_shard_bytes < 1:
            raise ValueError(f"max_shard_bytes must be >= 1, got {self.max_shard_bytes}")
        if self.chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be >= 4096, got {self.chunk_bytes}")
        if self.replay_backend not in REPLAY_BACKENDS:
            raise ValueError(
                f"replay_backend must be one of {REPLAY_BACKENDS}, got {self.replay_backend!r}"
            )
        if self.host_buffer_bytes is not None and self.host_buffer_bytes < 1:
            raise ValueError(f"host_buffer_bytes must be >= 1 or None, got {self.host_buffer_bytes}")
        if self.replay_bytes_per_s is not None and self.replay_bytes_per_s <= 0:
            raise ValueError(f"replay_bytes_per_s must be > 0 or None, got {self.replay_bytes_per_s}")
        if self.host_link_bytes_per_s is not None and self.host_link_bytes_per_s <= 0:
            raise ValueError(
                f"host_link_bytes_per_s must be > 0 or None, got {self.host_link_bytes_per_s}"
            )
        if self.io_nice is not None and (
            isinstance(self.io_nice, bool) or not isinstance(self.io_nice, int)
            or not 0 <= self.io_nice <= 19
        ):
            raise ValueError(f"io_nice must be an int in [0, 19] or None, got {self.io_nice!r}")
        for name in ("storage_timeout_s", "slot_wait_timeout_s"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0
            ):
                raise ValueError(f"{name} must be > 0 (seconds) or None, got {value!r}")

    def _check_types(self) -> None:
        """Each field of the type its annotation names, normalised: an ``int`` field takes an
        integer or a float of integral value (``1e9``), never a bool; a ``float`` field any
        real number but NaN (``inf`` where None is allowed becomes None: no bound); a ``bool`` field a bool (numpy's too), never a string;
        ``storage_options=None`` is ``{}``. A wrong type would otherwise pass the range checks
        and fail later, inside a save, with a bare ``TypeError``."""
        for f in dataclasses.fields(self):
            value, kind = getattr(self, f.name), str(f.type)
            if value is None and kind.endswith("| None"):
                continue
            base = kind.removesuffix(" | None")
            fixed: Any = value
            if base == "int":
                ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
                    and math.isfinite(value) and float(value) == int(value)
                fixed = int(value) if ok else value
            elif base == "float":
                ok = isinstance(value, numbers.Real) and not isinstance(value, (bool, np.bool_)) \
                    and not math.isnan(value)
                if ok and math.isinf(value) and value > 0 and kind.endswith("| None"):
                    fixed = None  # an unbounded timeout or an unthrottled rate: None says so
            elif base == "bool":
                ok = isinstance(value, (bool, np.bool_))
                fixed = bool(value) if ok else value
            elif base == "str":
                ok = isinstance(value, str)
            else:
                ok = value is None or isinstance(value, Mapping)
                fixed = {} if value is None else value
            if not ok:
                what = {"int": "an integer", "float": "a number (not NaN)", "bool": "True or False",
                        "str": "a str"}.get(base, "a mapping")
                none = " or None" if kind.endswith("| None") else ""
                raise ValueError(f"{f.name} must be {what}{none}, got {value!r}")
            if fixed is not value:
                object.__setattr__(self, f.name, fixed)  # frozen: normalised once, here
