"""Writes to a multi-step save's copied blocks that no optimizer update made.

A multi-step save (GoCkpt §4.2) copies block j during window j and brings it forward to the
captured step by replaying the later updates' gradients (§4.3). That holds only while nothing
but ``optimizer.step()`` writes those tensors between the copy and the captured step. A loop
may write them anyway: a max-norm clamp in a hook, a weight swap, WGAN-style
``p.data.clamp_()``. Such a write, if unseen, leaves the host copy a step (or an edit) behind
the live state, and the checkpoint would be torn.

:class:`EditWatch` notices such writes per save, from each block's copy until the step is
captured, at every window end and at the capture:

* **Version counters** of every tracked tensor (parameter and optimizer state), taken after each
  update: any in-place write through the tensor or an alias sharing its counter (``detach()``,
  a view) moves it. Exact.
* **Sampled contents** of every tracked tensor (``SAMPLES`` elements at a fixed stride, on the
  tensor's device), taken after each update: writes that bypass the counter (through ``.data``,
  a NumPy or DLPack alias) change them. A write that changes a fraction ``f`` of a tensor's
  elements, spread over it, escapes with probability about ``(1 - f) ** SAMPLES``; one that
  changes a few elements (a clamp of rare outliers) may escape. The comparison runs on the
  device and is read back once, at the capture (:meth:`edited`).

The units found written are not taken from the host copy: their live tensors are copied at the
capture (the state tree's copy of untracked tensors, :func:`gockpt.snapshot.to_skeleton`), so the
checkpoint still equals a blocking save at the captured step.

Cost on the training thread: one ``torch.cat`` of the samples per block (or per device and
dtype) at each window end and after each update. On one CPU core a cat of 144 strided sample
views takes about 0.1 ms with the parameters in cache, more when an update larger than the
caches has just written them (each sample is a cache miss): :class:`ParamSampler`, which runs
at every step, took 0.7-0.8 ms per step (median) for 144 parameters of 64K fp32 elements right
after an SGD update when it sampled all of them, 0.32 ms sampling one eighth per step. Runs of
consecutive elements miss the cache less, but a cat of such 2-D views took longer in cache
(0.16 ms) and sees fewer rows; on a GPU the cat is one kernel launch.
"""

from __future__ import annotations

import torch

from .layout import StateLayout, _dense, local

#: Elements sampled per parameter: 64 catches an edit of 5 % of a tensor's elements with
#: probability 1 - 0.95 ** 64 > 0.96, of 10 % with > 0.998, at 256 bytes per fp32 parameter.
SAMPLES = 64

# Samples are compared as bit patterns of their width: a NaN equals itself, -0.0 is not 0.0.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _sample_view(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """About ``n`` elements of ``t`` spread over it, as a view (None: ``t`` is empty, its
    elements are wider than 8 bytes, or they are not one dense range of its storage, so no
    strided view reaches them all)."""
    t = t.detach()  # views of a detached alias: nothing recorded for autograd
    numel = t.numel()
    if numel == 0 or t.element_size() not in _BITS:
        return None
    if t.is_contiguous():
        flat = t.view(-1)
    elif _dense(t):  # channels_last and other orders: one dense range of the storage
        flat = t.as_strided((numel,), (1,), t.storage_offset())
    else:
        return None
    m = min(n, numel)
    step = numel // m
    start = (numel * 2654435761) % step  # spread the phase: not always the first element
    return flat[start:start + step * m:step]


def _read_later(flag: torch.Tensor) -> tuple[torch.Tensor, object]:
    """A CUDA ``flag`` copied to pinned host memory behind the work queued on its device, and
    the event that tells the copy has ended."""
    stream = torch.cuda.current_stream(flag.device)
    host = torch.empty(flag.shape, dtype=flag.dtype, pin_memory=True)
    with torch.cuda.stream(stream):
        host.copy_(flag, non_blocking=True)
    event = torch.cuda.Event()
    event.record(stream)
    return host, event


class _Group:
    """Sampled parameters of one device and dtype: their views, their samples after the last
    update (bit patterns), and the sampled positions found changed since (on that device)."""

    def __init__(self, views: list[torch.Tensor], owners: list[tuple[int, int]]) -> None:
        self.views = views
        self.owners = owners  # (owner index, number of its samples), in views' order
        self.base = self.take()
        self.diff = torch.zeros(self.base.shape, dtype=torch.bool, device=self.base.device)

    def take(self) -> torch.Tensor:
        """The samples now, as bit patterns."""
        out = torch.cat(self.views)
        return out.view(_BITS[out.element_size()])

    def changed(self) -> torch.Tensor:
        """Per sampled position, whether it differs from :attr:`base` (on the device)."""
        return self.take() != self.base

    def owners_changed(self) -> set[int]:
        flags = self.diff.tolist()  # the read back (a sync on an accelerator)
        out, at = set(), 0
        for owner, n in self.owners:
            if any(flags[at:at + n]):
                out.add(owner)
            at += n
        return out


def _groups(tensors: list[tuple[int, torch.Tensor]]) -> list[_Group]:
    """One :class:`_Group` per (device, dtype) of the sample views of ``tensors`` (owner, tensor)."""
    return _grouped([(owner, view) for owner, t in tensors
                     if (view := _sample_view(t, SAMPLES)) is not None])


def _grouped(views: list[tuple[int, torch.Tensor]]) -> list[_Group]:
    """One :class:`_Group` per (device, dtype) of ``views`` (owner, sample view)."""
    by: dict[tuple, tuple[list, list]] = {}
    for owner, view in views:
        vs, owners = by.setdefault((view.device, view.dtype), ([], []))
        vs.append(view)
        owners.append((owner, view.numel()))
    return [_Group(v, o) for v, o in by.values()]


def _unit_views(layout: StateLayout, i: int) -> list[torch.Tensor]:
    """The sample views of unit ``i``'s parameter and its non-0-dim optimizer state, built once
    per layout (a layout's tensors keep their storage: the engine builds a new layout where
    one changes). Building them is Python per tensor, about 10 us each, where the samples'
    cat is one call: every multi-step save watches every unit."""
    cache = layout.__dict__.setdefault("_gockpt_unit_views", {})
    views = cache.get(i)
    if views is None:
        u = layout.units[i]
        # 0-dim state (Adam's step, kept on the CPU beside CUDA parameters) by its counter
        # only: sampling it would make a host group, read with a sync.
        views = [v for e in u.entries if e is u.param_entry or e.tensor.dim()
                 if (v := _sample_view(e.tensor, SAMPLES)) is not None]
        cache[i] = views
    return views


class EditWatch:
    """Per save: the tracked tensors of the blocks it has copied, and the writes to them that no
    optimizer update made (see the module docstring). Training thread only.

    Args:
        layout: the save's state layout (its units).
    """

    def __init__(self, layout: StateLayout) -> None:
        self._layout = layout
        # (unit index, tensor carrying the version counter, its version after the last update)
        self._versions: list[tuple[int, torch.Tensor, int]] = []
        self._groups: list[_Group] = []
        self._seen: set[int] = set()  # units whose counter moved

    def add(self, units: list[int] | tuple[int, ...]) -> None:
        """Watch ``units`` from now (their block's copy starts): their state now is the baseline."""
        for i in units:
            for e in self._layout.units[i].entries:
                self._versions.append((i, e.versioned, e.versioned._version))
        # Parameters and their optimizer state (a write to exp_avg through .data would make the
        # replay start from stale state).
        self._groups.extend(_grouped([(i, v) for i in units for v in _unit_views(self._layout, i)]))

    def check(self) -> None:
        """Compare the watched tensors with their baseline (a window end, the capture): writes
        since the last update are remembered. No host sync for the sampled contents."""
        for i, t, v in self._versions:
            if t._version != v:
                self._seen.add(i)
        for g in self._groups:
            g.diff |= g.changed()

    def rebase(self) -> None:
        """An update was applied: the watched tensors' state now is the new baseline."""
        self._versions = [(i, t, t._version) for i, t, _ in self._versions]
        for g in self._groups:
            g.base = g.take()

    def sampled_later(self) -> list[tuple[torch.Tensor, object]]:
        """After :meth:`check`, the sampled comparison of the CUDA groups as flags to read
        later (pinned host copies with their events; empty where there are none)."""
        return [_read_later(g.diff.any()) for g in self._groups if g.diff.device.type == "cuda"]

    def edited(self, host_only: bool = False) -> set[int]:
        """The units written outside an update since the watch began, as of the last
        :meth:`check` (version counters, and the sampled comparisons read back to the host: one
        sync per device and dtype; ``host_only``: only those of groups not on a CUDA device,
        no sync)."""
        for g in self._groups:
            if host_only and g.diff.device.type == "cuda":
                continue
            self._seen |= g.owners_changed()
            g.diff.zero_()
        return set(self._seen)


class ParamSampler:
    """Between updates, whether any parameter was written through a path that bypasses its
    version counter (``.data``, a NumPy or DLPack alias): sampled contents (``SAMPLES`` per
    parameter, as :class:`EditWatch`) taken after an update and compared right before the
    next. What the version counters tell (:meth:`gockpt._windows.Windows.edited_since_update`)
    is not repeated here.

    Each update samples one of ``PHASES`` interleaved subsets of the parameters in turn, not
    all of them: a loop that writes a parameter through ``.data`` between every two updates
    (a clamp, a projection) is seen within ``PHASES`` updates, at 1/``PHASES`` of the cost.
    What this decides is only how later saves are planned (copied at their request); a
    save's own copy windows are watched whole by :class:`EditWatch`, which keeps its
    checkpoint exact whatever this one missed.

    The comparison runs on the parameters' devices; :meth:`seen` reads it back without waiting
    on a CUDA device (a result not ready yet is read at a later call).
    """

    #: Interleaved subsets of the parameters, one sampled per update.
    PHASES = 8

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._phases: list[list[_Group]] = []
        self._phase = 0  # the subset whose baseline the last rebase took, which checks compare
        self._pending: list[tuple[torch.Tensor, object]] = []  # (host flag, its CUDA event)
        self._seen = False

    def rebase(self, params: list[torch.Tensor]) -> None:
        """An update was applied to ``params`` (every optimizer's): the next subset's contents
        now are its baseline, which every :meth:`check` until the next update compares with
        (the views are built again when the list or a storage changes)."""
        # A plain tensor's address too: p.data = other (module.half(), .to()) gives it another
        # storage, which the old views would not see (and would keep alive).
        key = tuple((id(p), p.data_ptr() if type(p) is torch.nn.Parameter or type(p) is torch.Tensor
                     else 0) for p in params)
        if key != self._key:
            self._key = key
            tensors = [(i, local(p)) for i, p in enumerate(params)]  # DTensor: its shard
            n = max(1, min(self.PHASES, len(tensors)))  # no empty subset
            self._phases = [_groups(tensors[k::n]) for k in range(n)]
            self._phase = 0  # every subset's baseline was just taken; the first is compared
            return
        self._phase = (self._phase + 1) % len(self._phases)
        for g in self._phases[self._phase]:
            g.base = g.take()

    def check(self) -> None:
        """Before an update: note whether a sampled element of the current subset changed
        since the last update."""
        for g in self._phases[self._phase] if self._phases else ():
            changed = g.changed().any()
            if changed.device.type == "cuda":  # read back later, without a sync now
                self._pending.append(_read_later(changed))
            else:  # the CPU; another accelerator: read now
                self._seen |= bool(changed)

    def seen(self) -> bool:
        """Whether a check found a change (those whose results reached the host)."""
        while self._pending and self._pending[0][1].query():  # type: ignore[attr-defined]
            self._seen |= bool(self._pending.pop(0)[0])
        return self._seen


def state_sample(layout: StateLayout) -> list[torch.Tensor]:
    """The sampled contents of every parameter and buffer of ``layout`` now (bit patterns, one
    tensor per device and dtype; the views are built once per layout). Two samples of one
    layout compare with :func:`same_sample`: a snapshot taken at a step may be shared by a later
    request at that step only while its tensors still hold what it copied: writes through
    ``.data`` move no version counter, nor does a train-mode forward of a batch norm, which
    updates its running statistics in place (a forward between two saves of one step)."""
    groups = layout.__dict__.get("_gockpt_sample_groups")
    if groups is None:
        n = len(layout.units)
        groups = _groups([(i, u.param_entry.tensor) for i, u in enumerate(layout.units)]
                         + [(n + j, e.tensor) for j, e in enumerate(layout.static)])
        layout.__dict__["_gockpt_sample_groups"] = groups
    return [g.take() for g in groups]


def same_sample(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    """Whether two :func:`state_sample` results of one layout are equal (a host sync on an
    accelerator)."""
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
