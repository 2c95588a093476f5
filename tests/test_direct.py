"""Local shard files written around the page cache (``gockpt._direct``)."""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import gc
import logging
import mmap
import os

import numpy as np
import pytest
import torch
import xxhash

import gockpt
from gockpt import _direct, cli

_SIZES = [17, 4096, _direct.BOUNCE_BYTES, _direct.BOUNCE_BYTES + 5, 123_457, 0, 3]


def _pieces(seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, n, dtype=np.uint8).tobytes() for n in _SIZES]


def _resident_pages(path: str) -> int:
    """Pages of ``path`` in the page cache (``mincore`` of a read-only mapping)."""
    size = os.path.getsize(path)
    libc = ctypes.CDLL(None, use_errno=True)
    with open(path, "rb") as f, mmap.mmap(f.fileno(), size, access=mmap.ACCESS_READ) as m:
        pages = -(-size // mmap.PAGESIZE)
        vec = (ctypes.c_ubyte * pages)()
        addr = np.frombuffer(m, dtype=np.uint8).ctypes.data
        if libc.mincore(ctypes.c_void_p(addr), ctypes.c_size_t(size), vec) != 0:
            raise OSError(ctypes.get_errno(), "mincore")
        return sum(v & 1 for v in vec)


def _direct_allowed(directory: str) -> bool:
    fd = os.open(os.path.join(directory, "probe"), os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        return _direct._set_direct(fd, True)  # noqa: SLF001 - the probe of the module's own rule
    finally:
        os.close(fd)


@pytest.mark.parametrize("direct", [True, False])
def test_write_file_writes_every_byte_with_its_checksum(tmp_path, direct):
    """Pieces of any size (none aligned, one larger than the bounce buffer, an empty one,
    read-only bytes and memoryviews) give the same file, size and xxh3 either way; a longer
    file at the path is replaced, not overwritten in part."""
    path = str(tmp_path / "shard")
    with open(path, "wb") as f:
        f.write(b"x" * (3 * _direct.BOUNCE_BYTES))
    pieces = _pieces()
    digest = xxhash.xxh3_64()
    views = [memoryview(p) if i % 2 else p for i, p in enumerate(pieces)]
    n = _direct.write_file(path, iter(views), lambda: None, digest, direct=direct)
    data = open(path, "rb").read()
    assert data == b"".join(pieces)
    assert n == len(data) == sum(_SIZES)
    assert digest.hexdigest() == xxhash.xxh3_64(data).hexdigest()


def test_a_failed_check_stops_the_write(tmp_path):
    path = str(tmp_path / "shard")
    calls = []

    def check():
        calls.append(1)
        if len(calls) == 3:
            raise RuntimeError("cancelled")

    with pytest.raises(RuntimeError, match="cancelled"):
        _direct.write_file(path, iter(_pieces()), check, xxhash.xxh3_64())
    assert len(calls) == 3


@pytest.mark.parametrize("direct_io", [True, False])
def test_checkpoint_shards_bypass_the_page_cache(tmp_path, direct_io):
    """A checkpoint saved to a local path leaves its shard files out of the page cache (the
    device read them from the bounce buffer), and loads bit-identical; with
    ``direct_io=False`` they are written through the cache (just written: still in it)."""
    if direct_io and not _direct_allowed(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT: shards are written buffered here")
    torch.manual_seed(0)
    model = torch.nn.Linear(512, 512)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 512)).sum().backward()
    opt.step()
    path = str(tmp_path / "ckpt")
    with gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync", direct_io=direct_io)) as eng:
        eng.save(path).result()
    shards = [f for f in os.listdir(path) if f.endswith(".safetensors")]
    assert shards
    for name in shards:
        resident = _resident_pages(os.path.join(path, name))
        pages = -(-os.path.getsize(os.path.join(path, name)) // mmap.PAGESIZE)
        assert resident == (0 if direct_io else pages), (name, resident, pages)
    ck = gockpt.load_checkpoint(path)
    for k, v in model.state_dict().items():
        assert torch.equal(ck.model_state_dict[k], v), k


class _PickyDevice:
    """``os.write`` as a filesystem answers it that accepts ``O_DIRECT`` at ``fcntl`` and then
    refuses (``EINVAL``) a direct write whose length or file offset is not a multiple of
    8192 bytes ("refuse"), or writes only half of each direct write ("short"); buffered
    writes as usual. The seam is the system call the writer makes, as an ``LD_PRELOAD``
    shim would see it."""

    def __init__(self, how: str) -> None:
        self.how, self.refused, self.short = how, 0, 0
        self.write = os.write

    def __call__(self, fd: int, data) -> int:
        if not fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            return self.write(fd, data)
        n = memoryview(data).nbytes
        if self.how == "refuse" and (n % 8192 or os.lseek(fd, 0, os.SEEK_CUR) % 8192):
            self.refused += 1
            raise OSError(errno.EINVAL, "Invalid argument")
        if self.how == "short" and n > _direct.ALIGN:
            self.short += 1
            return self.write(fd, memoryview(data).cast("B")[: n // 2 // _direct.ALIGN * _direct.ALIGN])
        return self.write(fd, data)


@pytest.mark.parametrize("how", ["refuse", "short"])
def test_a_direct_write_refused_or_short_mid_file_leaves_the_bytes_in_order(tmp_path, monkeypatch, how):
    """A direct write refused (``EINVAL``) or short in the middle of a file turns the rest of
    it buffered: the bytes still in the bounce buffer are written before the next ones, so the
    file is the pieces in order with the checksum of its own bytes; a checkpoint saved that
    way loads bit-identical and ``gockpt verify`` passes."""
    if not _direct_allowed(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT: nothing is written direct here")
    device = _PickyDevice(how)
    monkeypatch.setattr(os, "write", device)
    # A shard's header, then its data from a page-aligned host buffer, lined up with the file's
    # pages (as plan_slot places it), in chunks of 3 whole pages and a tail: the pages go
    # straight from the buffer (a direct write of 12288 bytes: refused, or short), the tail
    # through the bounce buffer.
    header = b"h" * 4100
    chunk = (_direct.ALIGN - 4) + 3 * _direct.ALIGN + 100
    slot = _direct.aligned_empty(4 + 6 * chunk)
    data = slot[4:].numpy()
    data[:] = np.random.default_rng(1).integers(0, 256, len(data), dtype=np.uint8)
    pieces = [header, *(memoryview(data[i:i + chunk]) for i in range(0, len(data), chunk))]
    digest = xxhash.xxh3_64()
    path = str(tmp_path / "shard")
    n = _direct.write_file(path, iter(pieces), lambda: None, digest)
    written = open(path, "rb").read()
    assert device.refused + device.short > 0
    assert n == len(written) and written == header + data.tobytes()
    assert digest.hexdigest() == xxhash.xxh3_64(written).hexdigest()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(300, 301), torch.nn.Linear(301, 7))
    opt = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 300)).sum().backward()
    opt.step()
    ckpt = str(tmp_path / "ckpt")
    config = gockpt.GoCkptConfig(mode="sync", direct_io=True, max_shard_bytes=300_001, chunk_bytes=5003)
    with gockpt.Engine(model, opt, config) as eng:
        eng.save(ckpt).result()
    monkeypatch.undo()
    loaded = gockpt.load_checkpoint(ckpt)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.model_state_dict[k], v), k
    assert cli.main(["verify", ckpt]) == 0


@pytest.mark.parametrize("lined_up", [True, False])
@pytest.mark.parametrize("header_len", [8, 136, 4096, 4104, 12_000])
def test_page_aligned_data_goes_to_the_file_without_the_bounce_buffer(tmp_path, lined_up, header_len):
    """A header, then data in chunks of a page-aligned buffer that start ``header_len`` past a
    page boundary (as plan_slot places each shard's data): the file is header + data, and where
    the data lines up with the file's pages only the page joining the header to the data and
    the last partial page pass through the bounce buffer. Not lined up (8 bytes off), every
    byte is still written, through the bounce buffer."""
    if not _direct_allowed(str(tmp_path)):
        pytest.skip("this filesystem refuses O_DIRECT: nothing is written direct here")
    header = bytes(range(256)) * (header_len // 256) + b"h" * (header_len % 256)
    data_len = 3 * _direct.BOUNCE_BYTES + 777
    base = header_len % _direct.ALIGN + (0 if lined_up else 8)
    slot = _direct.aligned_empty(base + data_len)
    assert slot.data_ptr() % _direct.ALIGN == 0
    data = slot[base:].numpy()
    data[:] = 0xAB
    data[-777:] = np.arange(777) % 251  # a tail that is not a whole page
    chunk = 4 << 20
    pieces = [header, *(memoryview(data[i:i + chunk]) for i in range(0, data_len, chunk))]
    _direct._bounce()[:] = 0  # this thread's bounce buffer, cleared to see what passes through
    digest = xxhash.xxh3_64()
    n = _direct.write_file(str(tmp_path / "shard"), iter(pieces), lambda: None, digest)
    written = open(tmp_path / "shard", "rb").read()
    assert n == len(written) == header_len + data_len
    assert written == header + data.tobytes()
    assert digest.hexdigest() == xxhash.xxh3_64(written).hexdigest()
    bulk = int((_direct._bounce() == 0xAB).sum())
    if lined_up:
        assert bulk < 2 * _direct.ALIGN
    else:
        assert bulk > _direct.BOUNCE_BYTES // 2  # it held the data, a buffer-full at a time


def test_slot_layout_puts_each_shards_data_where_its_file_offset_is_page_aligned():
    from gockpt.format import TensorSpec
    from gockpt.snapshot import plan_slot

    specs = [TensorSpec(f"t{i}", torch.float32 if i % 3 else torch.bfloat16, (i + 1, 37))
             for i in range(40)]
    layout = plan_slot(specs, max_shard_bytes=2000)
    assert len(layout.shards) > 3
    ends = [b + s.data_bytes for b, s in zip(layout.bases, layout.shards)]
    for base, shard in zip(layout.bases, layout.shards):
        assert (base - len(shard.header)) % _direct.ALIGN == 0 and base % 8 == 0
        for key, (begin, end) in shard.offsets.items():
            assert layout.offsets[key] == base + begin
    assert all(e <= b for e, b in zip(ends, layout.bases[1:])) and ends[-1] <= layout.nbytes


class _Cudart:
    """Stands in for ``torch.cuda.cudart()`` on a machine without CUDA: records the host
    registrations, and refuses them when told to."""

    class cudaError:  # noqa: N801 - the name torch's binding uses
        success = 0

    def __init__(self, refuse: bool = False) -> None:
        self.refuse = refuse
        self.calls: list[tuple] = []

    def cudaHostRegister(self, ptr: int, size: int, flags: int) -> int:  # noqa: N802
        self.calls.append(("register", ptr, size, flags))
        return 2 if self.refuse else 0  # 2: cudaErrorMemoryAllocation

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        self.calls.append(("unregister", ptr))
        self.mapped_at_unregister = _mapped(ptr)
        return 0

    def cudaGetErrorString(self, err: int) -> str:  # noqa: N802
        return f"error {err}"


@pytest.fixture
def cudart(monkeypatch):
    fake = _Cudart()
    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())
    return fake


def _mapped(addr: int) -> bool:
    """Whether this process maps ``addr`` (``/proc/self/maps``)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


def test_pinned_host_buffer_is_registered_at_its_size_and_unregistered_when_dropped(cudart):
    n = (1 << 22) + 5  # torch's pinned allocator would hold 8 MiB
    buf = _direct.aligned_empty(n, pin_memory=True)
    (reg,) = cudart.calls
    assert reg[0] == "register" and reg[2] == n + _direct.ALIGN and reg[3] == 1  # portable
    assert buf.numel() == n and buf.data_ptr() % _direct.ALIGN == 0
    assert reg[1] <= buf.data_ptr() and buf.data_ptr() + n <= reg[1] + reg[2]
    buf.fill_(7)
    view = buf[10:20]  # views keep it registered and mapped
    del buf
    gc.collect()
    assert len(cudart.calls) == 1 and int(view.sum()) == 70
    del view
    gc.collect()
    assert cudart.calls[1:] == [("unregister", reg[1])]
    assert cudart.mapped_at_unregister and not _mapped(reg[1])  # unregistered, then unmapped


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_pinned_host_buffer_is_not_inherited_by_a_forked_child(cudart):
    """A DataLoader worker forked after a save must not share (or copy) pages the GPU writes."""
    buf = _direct.host_empty(1 << 20, pin_memory=True)
    other = torch.empty(1 << 20, dtype=torch.uint8)  # ordinary memory is inherited
    assert _mapped(buf.data_ptr())
    pid = os.fork()
    if pid == 0:  # the child: report what it maps, touch nothing else
        os._exit((2 if _mapped(buf.data_ptr()) else 0) + (0 if _mapped(other.data_ptr()) else 4))
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    del buf
    gc.collect()
    assert [c[0] for c in cudart.calls] == ["register", "unregister"]  # once, by the parent


def test_pinned_host_buffer_falls_back_to_torch_where_cuda_refuses(cudart, monkeypatch, caplog):
    cudart.refuse = True
    monkeypatch.setattr(_direct, "_register_warned", False)
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        if torch.cuda.is_available():
            assert _direct.host_empty(1000, pin_memory=True).is_pinned()
        else:
            with pytest.raises(RuntimeError):  # torch's own pinned allocation, without CUDA
                _direct.host_empty(1000, pin_memory=True)
    assert "could not page-lock 1000 bytes" in caplog.text and "error 2" in caplog.text
    assert [c[0] for c in cudart.calls] == ["register"]  # nothing left registered
    assert _direct.host_empty(0, pin_memory=True).numel() == 0  # nothing to pin
    assert len(cudart.calls) == 1
