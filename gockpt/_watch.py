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
* **Sampled contents** of every parameter (``SAMPLES`` elements at a fixed stride, on the
  tensor's device), taken after each update: writes that bypass the counter (through ``.data``,
  a NumPy or DLPack alias) change them. A write that changes a fraction ``f`` of a tensor's
  elements, spread over it, escapes with probability about ``(1 - f) ** SAMPLES``; one that
  changes a few elements (a clamp of rare outliers) may escape. The comparison runs on the
  device and is read back once, at the capture (:meth:`edited`).

The units found written are not taken from the host copy: their live tensors are copied at the
capture (the state tree's copy of untracked tensors, :func:`gockpt.snapshot.to_skeleton`), so the
checkpoint still equals a blocking save at the captured step.
"""

from __future__ import annotations

import torch

from .layout import StateLayout, _dense, local

#: Elements sampled per parameter: 64 catches an edit of 5 % of a tensor's elements with
#: probability 1 - 0.95 ** 64 > 0.96, of 10 % with > 0.998, at 256 bytes per fp32 parameter.
SAMPLES = 64


def _sample_view(t: torch.Tensor, n: int) -> torch.Tensor | None:
    """About ``n`` elements of ``t`` spread over it, as a view (None: ``t`` is empty or its
    elements are not one dense range of its storage, so no strided view reaches them all)."""
    t = t.detach()  # views of a detached alias: nothing recorded for autograd
    numel = t.numel()
    if numel == 0:
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


class _Group:
    """The sampled parameters of one block on one device: their views, their samples after the
    last update, and the sampled positions found changed since (on that device)."""

    def __init__(self, views: list[torch.Tensor], owners: list[tuple[int, int]]) -> None:
        self.views = views
        self.owners = owners  # (unit index, number of its samples), in views' order
        self.base = torch.cat(views)
        self.diff = torch.zeros(self.base.shape, dtype=torch.bool, device=self.base.device)

    def units_changed(self) -> set[int]:
        flags = self.diff.tolist()  # the read back (a sync on an accelerator)
        out, at = set(), 0
        for unit, n in self.owners:
            if any(flags[at:at + n]):
                out.add(unit)
            at += n
        return out


class EditWatch:
    """Per save: the tracked tensors of the blocks it has copied, and the writes to them that no
    optimizer update made (see the module docstring). Training thread only.

    Args:
        layout: the save's state layout (its units).
    """

    def __init__(self, layout: StateLayout) -> None:
        self._layout = layout
        self._units: list[int] = []
        # (unit index, tensor carrying the version counter, its version after the last update)
        self._versions: list[tuple[int, torch.Tensor, int]] = []
        self._groups: list[_Group] = []
        self._seen: set[int] = set()  # units whose counter moved

    @property
    def units(self) -> list[int]:
        """Indices (into ``layout.units``) of the units watched, in the order added."""
        return self._units

    def add(self, units: list[int] | tuple[int, ...]) -> None:
        """Watch ``units`` from now (their block's copy starts): their state now is the baseline."""
        by_dev: dict[torch.device, tuple[list, list]] = {}
        for i in units:
            u = self._layout.units[i]
            self._units.append(i)
            for e in u.entries:
                self._versions.append((i, e.versioned, e.versioned._version))
            view = _sample_view(u.param_entry.tensor, SAMPLES)
            if view is not None:
                views, owners = by_dev.setdefault(view.device, ([], []))
                views.append(view)
                owners.append((i, view.numel()))
        self._groups.extend(_Group(v, o) for v, o in by_dev.values())

    def check(self) -> None:
        """Compare the watched tensors with their baseline (a window end, the capture): writes
        since the last update are remembered. No host sync for the sampled contents."""
        for i, t, v in self._versions:
            if t._version != v:
                self._seen.add(i)
        for g in self._groups:
            g.diff |= torch.cat(g.views) != g.base

    def rebase(self) -> None:
        """An update was applied: the watched tensors' state now is the new baseline."""
        self._versions = [(i, t, t._version) for i, t, _ in self._versions]
        for g in self._groups:
            g.base = torch.cat(g.views)

    def edited(self) -> set[int]:
        """The units written outside an update since the watch began (reads the sampled
        comparisons back to the host: one sync per block and device)."""
        for g in self._groups:
            self._seen |= g.units_changed()
            g.diff.zero_()
        return set(self._seen)


class ParamSampler:
    """Between updates, whether any parameter was written through a path that bypasses its
    version counter (``.data``, a NumPy or DLPack alias): sampled contents (``SAMPLES`` per
    parameter, as :class:`EditWatch`) taken after each update and compared right before the
    next. What the version counters tell (:meth:`gockpt._windows.Windows.edited_since_update`)
    is not repeated here. A parameter whose storage is replaced (``p.data = other``) keeps
    being sampled from its old storage until the parameters are listed again (:meth:`rebase`
    with another list).

    The comparison runs on the parameters' devices; :meth:`seen` reads it back without waiting
    on an accelerator (a result not ready yet is read at a later call).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._groups: list[_Group] = []
        self._pending: list[tuple[torch.Tensor, object]] = []  # (host flag, its CUDA event)
        self._seen = False

    def rebase(self, params: list[torch.Tensor]) -> None:
        """An update was applied to ``params`` (every optimizer's): their contents now are the
        baseline (the views are built again when the list changes)."""
        key = tuple(id(p) for p in params)
        if key != self._key:
            self._key = key
            by_dev: dict[torch.device, tuple[list, list]] = {}
            for i, p in enumerate(params):
                view = _sample_view(local(p), SAMPLES)  # a DTensor: its local shard
                if view is not None:
                    views, owners = by_dev.setdefault(view.device, ([], []))
                    views.append(view)
                    owners.append((i, view.numel()))
            self._groups = [_Group(v, o) for v, o in by_dev.values()]
            return
        for g in self._groups:
            g.base = torch.cat(g.views)

    def check(self) -> None:
        """Right before an update: note whether a sampled element changed since the last one."""
        for g in self._groups:
            changed = (torch.cat(g.views) != g.base).any()
            if changed.device.type == "cpu":
                self._seen |= bool(changed)
            else:  # read back later, without a sync now
                flag = changed.to("cpu", non_blocking=True)
                event = torch.cuda.Event()
                event.record()
                self._pending.append((flag, event))

    def seen(self) -> bool:
        """Whether a check found a change (those whose results reached the host)."""
        while self._pending and self._pending[0][1].query():  # type: ignore[attr-defined]
            self._seen |= bool(self._pending.pop(0)[0])
        return self._seen
