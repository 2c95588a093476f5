"""``torch.save`` files of host tensors, built without holding the GIL for their bytes.

A framework's own files (Accelerate's ``optimizer.bin``, ``pytorch_model.bin``) are
``torch.save`` zip archives, built by a persist thread while the training thread runs.
``torch.save`` writes each storage record from C++ with the GIL released (it computes the
record's CRC-32 there too), but hands the bytes to the file object's ``write``; an
``io.BytesIO`` copies them with the GIL held, again on every growth of its buffer and in
``getvalue``. And the snapshot's tensors are views of one host buffer, which ``torch.save``
would write whole for each, so they had to be cloned first. Together 25-45 ms of GIL per 40 MB
of optimizer state (measured on 2 shared cores), which the training thread waits out, and
about ten times that for 320 MB.

:func:`torch_file` gives ``torch.save`` each tensor in a storage of its own that *shares* the
snapshot's memory (:func:`shared_storage`: ``torch.from_numpy``, no copy), and a file object
whose ``write`` copies into one preallocated buffer with ``numpy.copyto``, which releases the
GIL. What holds the GIL is then the pickling of the small object tree and a few calls per
record, not the bytes. The result is byte for byte what ``torch.save`` writes into an
``io.BytesIO`` for :func:`gockpt.snapshot.own_storage` of the same tree.

Not used: ``torch.serialization.skip_data`` (write the archive with each record's space
reserved, then fill the records). It leaves every record's CRC-32 at 0 (the stdlib ``zipfile``
rejects such a record), and torch names no public way to learn which tensor went to which
``data/<key>`` record (keys are assigned in pickling order inside ``torch.save``). Made to work
(a pickler that notes the keys, the CRCs computed with ``zlib.crc32`` and patched in), it held
the GIL no shorter: the bytes were already off the GIL, and the ``zipfile`` parse and the
per-record patching are Python.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from .snapshot import map_views_once, own_copy

__all__ = ["shared_storage", "torch_file"]

# Room in the buffer beyond the tensors' bytes: per tensor (its zip headers, 64-byte alignment,
# its share of the pickle) and in all (the archive's own records). The buffer grows if short.
_RECORD_BYTES = 512
_SLACK_BYTES = 1 << 16


class _Buffer:
    """A write-only file for ``torch.save``: every write is copied into one growing buffer.

    ``numpy.copyto`` of ``uint8`` arrays releases the GIL for the copy, so a storage record,
    handed over as one ``memoryview`` of the tensor's memory, moves while the training thread
    runs Python.
    """

    def __init__(self, capacity: int) -> None:
        self._buf = np.empty(max(capacity, 1), dtype=np.uint8)
        self.size = 0

    def write(self, data: Any) -> int:
        src = np.frombuffer(data, dtype=np.uint8)
        end = self.size + src.size
        if end > self._buf.size:
            grown = np.empty(max(end, 2 * self._buf.size), dtype=np.uint8)
            np.copyto(grown[: self.size], self._buf[: self.size])
            self._buf = grown
        np.copyto(self._buf[self.size : end], src)
        self.size = end
        return src.size

    def flush(self) -> None:
        """Nothing is buffered (``torch.save`` flushes its file when done)."""

    def getbuffer(self) -> memoryview:
        """The bytes written, without a copy (1-D, ``uint8``)."""
        return self._buf[: self.size].data


def shared_storage(tree: Any) -> Any:
    """``tree`` with every tensor in a storage of its own that shares the tensor's memory.

    A tensor of a host snapshot is a view of one buffer: ``torch.save`` writes a view's whole
    storage, so each tensor gets a storage spanning exactly its own bytes (``torch.from_numpy``
    over the same memory; no copy). Tensors that are not contiguous, not on the CPU, not
    strided, empty, quantized or with a conjugate/negative bit, and one whose memory another
    tensor of the tree starts at with another dtype (``torch.save`` refuses two dtypes at one
    address), are copied instead, contiguous. Views of one place (tied weights, one tensor met
    twice) stay one tensor object, as :func:`gockpt.snapshot.own_storage` keeps them:
    ``torch.save`` writes the same bytes for both.

    The result shares memory with ``tree``: use it while ``tree``'s tensors are valid and
    unchanged.
    """
    return _shared_tree(tree)[0]


def _shared_tree(tree: Any) -> tuple[Any, int]:
    # The tree of shared_storage, and the room torch.save's file of it needs (about).
    starts: dict[int, torch.dtype] = {}
    made: list[torch.Tensor] = []

    def share(x: torch.Tensor) -> torch.Tensor:
        made.append(_shared(x.detach(), starts))
        return made[-1]

    out = map_views_once(tree, share)
    nbytes = sum(t.numel() * t.element_size() for t in made)
    return out, nbytes + _RECORD_BYTES * len(made) + _SLACK_BYTES


def _shared(t: torch.Tensor, starts: dict[int, torch.dtype]) -> torch.Tensor:
    plain = (t.device.type == "cpu" and t.layout == torch.strided and not t.is_quantized
             and not t.is_conj() and not t.is_neg() and t.is_contiguous() and t.numel() > 0)
    if not plain or starts.setdefault(t.data_ptr(), t.dtype) != t.dtype:
        return own_copy(t)
    # A uint8 view for numpy (it has no bfloat16, float8 ...); the dtype view is taken back.
    raw = t.reshape(-1).view(torch.uint8).numpy()
    return torch.from_numpy(raw).view(t.dtype).view(t.shape)


def torch_file(obj: Any) -> memoryview:
    """``torch.save(own_storage(obj))``'s file, its tensors' bytes copied outside the GIL.

    Meant for a persist thread: the GIL is held for the pickling of ``obj``'s small tree and a
    few calls per tensor, not for the tensors' bytes (see the module doc). The bytes are those
    ``torch.save`` writes into an ``io.BytesIO`` for :func:`gockpt.snapshot.own_storage` of
    ``obj`` (zip, CRC-32 of every record); ``torch.load`` (``weights_only=True`` included)
    reads them as it reads any.

    Args:
        obj: anything ``torch.save`` takes; its tensors are read during the call only.

    Returns:
        The file's bytes: a 1-D ``memoryview`` of ``uint8`` (``len`` in bytes) over a buffer
        of its own.

    Raises:
        What ``torch.save`` raises for ``obj`` (e.g. ``pickle.PicklingError``).
    """
    tree, capacity = _shared_tree(obj)
    out = _Buffer(capacity)
    torch.save(tree, out)  # type: ignore[arg-type]  # a file object: write and flush are all it uses
    return out.getbuffer()
