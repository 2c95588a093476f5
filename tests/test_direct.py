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
