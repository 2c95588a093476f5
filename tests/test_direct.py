"""Local shard files written around the page cache (``gockpt._direct``)."""

from __future__ import annotations

import ctypes
import mmap
import os

import numpy as np
import pytest
import torch
import xxhash

import gockpt
from gockpt import _direct

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
