"""Tensors a host slot still holds unchanged: not copied again (``frozen_copy="when_changed"``).

A slot is reused by one save after another (:class:`gockpt.transfer.SlotPool`), and its bytes
for a tensor that did not change since the last save copied it (a frozen parameter, a buffer
in eval mode, a LoRA base model) already hold the right data. :class:`HeldTensors` remembers,
per slot, which views were filled from which tensor at which version counter. A tensor is
taken as unchanged while it is the same tensor object at the same address, with the same
dtype, shape and strides, and its version counter has not moved: every in-place change made
through autograd-visible tensors bumps that counter (PyTorch's own check that a tensor saved
for backward was not modified). A write through ``tensor.data`` does not bump it, which is why
this is opt-in.

Only frozen parameters are remembered (``requires_grad=False``): those no optimizer holds, and
those an optimizer holds without state. Buffers are always copied: native kernels update some
of them in place without moving the version counter (BatchNorm's running statistics). The
replay writes into the views of units that get gradients, so a unit whose gradient is copied
is forgotten at once (:meth:`HeldTensors.forget`). Everything here runs on the training thread.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from .layout import StateLayout, Unit

# (the tensor whose version counter is checked, its version, data address, dtype, shape,
# strides, the address of its TensorImpl)
Fingerprint = tuple[torch.Tensor, int, int, torch.dtype, tuple[int, ...], tuple[int, ...], int]


def fingerprint(versioned: torch.Tensor, tensor: torch.Tensor) -> Fingerprint:
    """What must not change for a copy of ``tensor`` to stay valid; ``versioned`` carries the
    version counter (the ``DTensor`` of a local shard, else ``tensor`` itself).

    ``versioned`` is held by a strong reference, not a weak one: ``torch.utils.swap_tensors``
    (``load_state_dict`` and ``module.to()`` under torch's swap-on-conversion future) refuses a
    tensor that has a weak reference. Held, it cannot die and another tensor take its ``id``; a
    tensor replaced by another is let go at the next save that reuses the slot
    (:meth:`HeldTensors.keep_only`, :meth:`HeldTensors.forget`). A swap keeps the object but
    gives it another TensorImpl (``_cdata``)."""
    return (versioned, versioned._version, tensor.data_ptr(), tensor.dtype,
            tuple(tensor.shape), tuple(tensor.stride()), versioned._cdata)


def same(fp: Fingerprint, versioned: torch.Tensor, tensor: torch.Tensor) -> bool:
    held, version, ptr, dtype, shape, stride, cdata = fp
    return (held is versioned and versioned._cdata == cdata and versioned._version == version
            and tensor.data_ptr() == ptr and tensor.dtype == dtype
            and tuple(tensor.shape) == shape and tuple(tensor.stride()) == stride)


def rememberable(u: Unit) -> bool:
    """Whether the replay can never write ``u``'s view: a frozen parameter without optimizer
    state (it gets no gradient, so nothing is replayed onto it)."""
    return not u.param.requires_grad and not u.state_entries


def rememberable_static(t: torch.Tensor) -> bool:
    """Whether a static tensor (no optimizer holds it) may be remembered: a frozen parameter.
    Not a buffer (see the module docstring)."""
    return isinstance(t, torch.nn.Parameter) and not t.requires_grad


class HeldTensors:
    """Per host slot: byte offset in ``slot.data`` -> the :class:`Fingerprint` of the tensor whose
    data those bytes hold, for views written only by copies.

    Each :meth:`remember` makes a new entry object, so the identity of the entries at a set of
    offsets says whether those bytes were copied again since: :meth:`entries` taken for a
    shard when one checkpoint was handed to the persist, and again for the next, are the same
    objects only if no byte of that shard was written in between. Then the file the first
    wrote holds the bytes the second would write, and the second links it
    (:attr:`origins`, :meth:`gockpt.targets.StorageTarget.link`).
    """

    def __init__(self) -> None:
        self._held: dict[int, tuple[int, Fingerprint]] = {}
        # Shard index -> (its header, its entries() when handed off, where its published file
        # is: a gockpt.targets.FileOrigin, the save's seq). Written by the persist thread that
        # published it, read by the next save's persist thread.
        self.origins: dict[int, tuple[bytes, tuple, Any, int]] = {}

    def __len__(self) -> int:
        return len(self._held)

    def keep_only(self, layout: StateLayout, offsets: dict[str, int]) -> None:
        """Forget every range that is not exactly a view of ``layout`` (offset and size), so
        that a copy into a view of it forgets all that it overwrites (:meth:`forget`)."""
        want = {offsets[e.key]: e.spec.nbytes for e in layout.entries}
        for off in list(self._held):
            if want.get(off) != self._held[off][0]:
                del self._held[off]

    def holds(self, offset: int, versioned: torch.Tensor, tensor: torch.Tensor) -> bool:
        """Whether the bytes at ``offset`` hold ``tensor`` as it is now."""
        got = self._held.get(offset)
        return got is not None and same(got[1], versioned, tensor)

    def likely_holds(self, offset: int, versioned: torch.Tensor, tensor: torch.Tensor) -> bool:
        """:meth:`holds` without the identity check, for the planner's estimate: the layout's
        aliases of static parameters are not the objects their copies were taken from."""
        got = self._held.get(offset)
        return (got is not None and got[1][1] == versioned._version
                and got[1][2] == tensor.data_ptr())

    def entries(self, offsets: Iterable[int]) -> tuple | None:
        """The entries held at ``offsets`` (compared by identity, see the class), or None where
        one of them holds nothing known."""
        out = []
        for off in offsets:
            e = self._held.get(off)
            if e is None:
                return None
            out.append(e)
        return tuple(out)

    def forget(self, offsets: Iterable[int]) -> None:
        """The bytes at ``offsets`` are about to be written (a copy, a replay)."""
        for off in offsets:
            self._held.pop(off, None)

    def remember(self, offset: int, nbytes: int, fp: Fingerprint) -> None:
        """The bytes at ``offset`` now hold the tensor of ``fp`` (its copy completed and its
        version was checked after the copy)."""
        self._held[offset] = (nbytes, fp)
