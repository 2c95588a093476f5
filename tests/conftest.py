"""Shared fixtures: stores for checkpoints (local, memory, S3 on loopback) and request builders.

- ``store``: parametrized over a local ``tmp_path`` directory and a unique ``memory://`` root.
- ``faulty_store``: ``(store, fault)`` — the same two behind the fault-injecting fsspec
  filesystems of ``tests/faultfs.py`` (the seam faults are injected through).
- ``s3_store``: a fresh bucket on a moto S3 server on 127.0.0.1.
- ``make_request`` / ``make_tensors``: build :class:`gockpt.persist.PersistRequest` objects
  whose slot holds the tensors at the planned offsets.
"""

from __future__ import annotations

import io
import os
import socket
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import faultfs
import fsspec
import pytest
import torch
from fsspec.implementations.memory import MemoryFileSystem

from gockpt import storage
from gockpt.format import ShardLayout, TensorSpec, plan_shards
from gockpt.persist import PersistRequest

# Processes the tests spawn (ranks, crash children) print a traceback of every thread when they
# die of a fatal signal, so an abort in a child says where it happened.
os.environ.setdefault("PYTHONFAULTHANDLER", "1")


@dataclass
class Store:
    """A directory that holds checkpoints.

    Attributes:
        root: local path or fsspec URL of the directory.
        storage_options: fsspec options for it.
        kind: "local", "memory" or "s3".
    """

    root: str
    storage_options: dict = field(default_factory=dict)
    kind: str = "local"

    def path(self, *names: str) -> str:
        """``root`` joined with ``names`` (same URL form)."""
        return "/".join([self.root.rstrip("/"), *names])

    @property
    def fs(self) -> fsspec.AbstractFileSystem:
        return storage.url_to_fs(self.root, self.storage_options)[0]

    def fs_path(self, *names: str) -> str:
        """The path of ``root``/``names`` inside :attr:`fs`."""
        return storage.url_to_fs(self.path(*names), self.storage_options)[1]

    def listing(self, *names: str) -> list[str]:
        """Sorted base names of the entries of ``root``/``names`` (empty if missing)."""
        fs = self.fs
        path = self.fs_path(*names)
        if not fs.exists(path):
            return []
        return sorted(p.rstrip("/").rpartition("/")[2] for p in fs.ls(path, detail=False))


def _clear_memory(fs: MemoryFileSystem, root: str) -> None:
    if fs.exists(root):
        fs.rm(root, recursive=True)


@pytest.fixture(params=["local", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Any) -> Iterator[Store]:
    """A local directory under ``tmp_path`` or a unique ``memory://`` root."""
    if request.param == "local":
        yield Store(str(tmp_path / "store"), kind="local")
        return
    name = f"gockpt-test-{uuid.uuid4().hex}"
    yield Store(f"memory://{name}", kind="memory")
    _clear_memory(fsspec.filesystem("memory"), f"/{name}")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def _moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    port = _free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{port}"
    server.stop()


@pytest.fixture
def s3_store(_moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> Store:
    """A fresh bucket on a loopback moto S3 server, as ``s3://<bucket>/ckpts``."""
    import s3fs

    for var in (
        "AWS_PROFILE",
        "AWS_SESSION_TOKEN",
        "AWS_CONFIG_FILE",
        "AWS_SHARED_CREDENTIALS_FILE",
    ):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    options = {
        "key": "testing",
        "secret": "testing",
        "client_kwargs": {"endpoint_url": _moto_endpoint},
    }
    bucket = f"gockpt-{uuid.uuid4().hex[:16]}"
    fs = s3fs.S3FileSystem(**options)
    fs.mkdir(bucket)
    fs.invalidate_cache()
    return Store(f"s3://{bucket}/ckpts", storage_options=options, kind="s3")


def build_slot(
    tensors: dict[str, torch.Tensor], shards: list[ShardLayout]
) -> tuple[torch.Tensor, list[int]]:
    """Copy ``tensors`` into one uint8 slot at the planned offsets; shards back to back."""
    slot = torch.zeros(sum(s.data_bytes for s in shards), dtype=torch.uint8)
    bases = []
    pos = 0
    for shard in shards:
        bases.append(pos)
        for key, (begin, end) in shard.offsets.items():
            flat = tensors[key].detach().contiguous().reshape(-1)
            slot[pos + begin : pos + end] = flat.view(torch.uint8)
        pos += shard.data_bytes
    return slot, bases


def _make_tensors(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "layer.weight": torch.randn(64, 33, generator=g),
        "layer.bias": torch.randn(33, generator=g).to(torch.bfloat16),
        "emb": torch.randn(50, 8, generator=g).to(torch.float16),
        "step": torch.tensor(seed + 7, dtype=torch.int64),
        "mask": torch.rand(17, generator=g) > 0.5,
        "empty": torch.empty(0, 4),
        "counts": torch.randint(-5, 5, (9,), generator=g, dtype=torch.int32),
    }


@pytest.fixture
def make_tensors() -> Callable[..., dict[str, torch.Tensor]]:
    """``make_tensors(seed)`` -> a dict of tensors of several dtypes and shapes (0-dim, empty)."""
    return _make_tensors


@pytest.fixture
def make_request() -> Callable[..., PersistRequest]:
    """``make_request(path, tensors, step=1, ...)`` -> a PersistRequest for ``tensors``.

    Keyword arguments: ``step`` (captured_step in meta), ``extra`` (object torch.save'd,
    default ``{"step": step}``), ``aliases``, ``max_shard_bytes`` (default 1 KiB: several
    shards), ``storage_options``; any other keyword sets a PersistRequest field.
    """

    def make(
        path: str,
        tensors: dict[str, torch.Tensor],
        *,
        step: int = 1,
        extra: Any = None,
        aliases: dict[str, str] | None = None,
        max_shard_bytes: int = 1024,
        storage_options: dict | None = None,
        **fields: Any,
    ) -> PersistRequest:
        specs = [TensorSpec(k, t.dtype, tuple(t.shape)) for k, t in tensors.items()]
        shards = plan_shards(specs, max_shard_bytes, f"shard-{uuid.uuid4().hex[:8]}")
        slot, bases = build_slot(tensors, shards)
        blob = io.BytesIO()
        torch.save({"step": step} if extra is None else extra, blob)
        fields.setdefault("chunk_bytes", 100)
        return PersistRequest(
            path=path,
            shards=shards,
            slot=slot,
            shard_bases=bases,
            extra=blob.getvalue(),
            aliases=dict(aliases or {}),
            meta={"captured_step": step, "requested_step": step, "mode": "sync"},
            storage_options=dict(storage_options or {}),
            **fields,
        )

    return make


@pytest.fixture
def one_thread_fresh_selfcheck():
    """One intra-op thread (the reference torch steps stay fast on a busy machine) and an empty
    self-check cache, restored afterwards."""
    from gockpt import selfcheck

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    selfcheck._cache.clear()
    yield
    selfcheck._cache.clear()
    torch.set_num_threads(threads)


@pytest.fixture(params=["local", "memory"])
def faulty_store(request, tmp_path, monkeypatch):
    """(store, fault): a local directory or an object store behind a fault-injecting fsspec
    filesystem (tests/faultfs.py), with a disarmed fault on checkpoint writes."""
    fault = faultfs.Fault()
    if request.param == "local":
        monkeypatch.setattr(faultfs.FaultLocalFileSystem, "fault", fault)
        yield Store(faultfs.local_url(tmp_path / "store"), kind="local"), fault
        return
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    root = faultfs.memory_root()
    yield Store(root, kind="memory"), fault
    faultfs.clear_memory(root)

