"""The staged commit of checkpoints a strategy writes in its own format (DeepSpeed, sharded FSDP).

Driven through :class:`lightning_gockpt.staged.StagedAdapterEngine`'s own interface with a
writer that writes plain files from a background thread, as the strategies' writers do; the
"strategy" is the seam the engine uses of Lightning's (``broadcast``, ``barrier``), for one
process, or for rank 0 of two where the other rank never delivers.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor

import pytest

from gockpt import GoCkptConfig
from lightning_gockpt.staged import StagedAdapterEngine


class OneProcess:
    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass


class FileWriter:
    """Writes ``checkpoint["files"]`` into the staging directory on a thread, after ``gate``."""

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False

    def __call__(self, stage: str, checkpoint: dict) -> tuple[Future, int]:
        files = dict(checkpoint["files"])  # taken at the request

        def run() -> int:
            self.gate.wait(30)
            if self.fail:
                raise OSError(28, "No space left on device")
            for name, data in files.items():
                with open(os.path.join(stage, name), "wb") as f:
                    f.write(data)
            return sum(map(len, files.values()))

        return self.pool.submit(run), sum(map(len, files.values()))


def _engine(writer, world=1, **kw) -> StagedAdapterEngine:
    return StagedAdapterEngine(OneProcess(), GoCkptConfig(max_inflight=2), writer, rank=0, world=world,
                               collective=lambda: True, **kw)


def _request(eng, path, files):
    return eng.save(str(path), state_fn=lambda: {"lightning": {"files": files}})


def _hidden(parent) -> list[str]:
    return sorted(n for n in os.listdir(parent) if n.startswith("."))


def test_a_checkpoint_appears_whole_and_replaces_the_previous_one(tmp_path):
    writer = FileWriter()
    eng = _engine(writer)
    path = tmp_path / "last.ckpt"
    _request(eng, path, {"a.pt": b"one"}).result(30)
    assert sorted(os.listdir(path)) == ["a.pt"]
    writer.gate.clear()
    handle = _request(eng, path, {"a.pt": b"two", "b.pt": b"2"})
    assert (path / "a.pt").read_bytes() == b"one" and not handle.done()  # the old one, untouched
    writer.gate.set()
    m = handle.result(30)
    assert sorted(os.listdir(path)) == ["a.pt", "b.pt"] and (path / "a.pt").read_bytes() == b"two"
    assert m.persist_bytes == 4 and m.mode == "lazy" and m.time_to_durable_s >= m.stall_s
    eng.close()
    assert _hidden(tmp_path) == []  # no staging, no markers, no lock left


def test_a_failed_write_publishes_nothing_and_keeps_the_previous_checkpoint(tmp_path):
    writer = FileWriter()
    eng = _engine(writer)
    path = tmp_path / "step.ckpt"
    _request(eng, path, {"a.pt": b"good"}).result(30)
    writer.fail = True
    handle = _request(eng, path, {"a.pt": b"torn"})
    with pytest.raises(OSError, match="No space left"):
        handle.result(30)
    assert (path / "a.pt").read_bytes() == b"good"
    assert _hidden(tmp_path) == []
    with pytest.raises(OSError):
        eng.close()  # the background error reaches the caller


def test_a_rank_that_never_delivers_leaves_no_checkpoint(tmp_path):
    eng = _engine(FileWriter(), world=2, commit_timeout_s=0.5)  # rank 1 never writes its marker
    path = tmp_path / "step.ckpt"
    with pytest.raises(TimeoutError, match="rank 1"):
        _request(eng, path, {"a.pt": b"x"}).result(30)
    assert not path.exists() and _hidden(tmp_path) == []


def test_removing_a_checkpoint_in_flight_waits_for_its_commit(tmp_path):
    writer = FileWriter()
    eng = _engine(writer)
    path = tmp_path / "old.ckpt"
    writer.gate.clear()
    handle = _request(eng, path, {"a.pt": b"x"})
    eng.remove(str(path))  # ModelCheckpoint dropping it from its top-k while it is written
    writer.gate.set()
    handle.result(30)
    eng.close()
    assert not path.exists() and _hidden(tmp_path) == []


def test_saves_in_flight_are_bounded_by_max_inflight(tmp_path):
    writer = FileWriter()
    eng = _engine(writer)  # max_inflight=2
    writer.gate.clear()
    first = _request(eng, tmp_path / "1.ckpt", {"a": b"1"})
    _request(eng, tmp_path / "2.ckpt", {"a": b"2"})
    threading.Timer(0.3, writer.gate.set).start()
    _request(eng, tmp_path / "3.ckpt", {"a": b"3"})  # waits for the first to finish
    assert first.done()
    eng.close()
    assert sorted(os.listdir(tmp_path)) == ["1.ckpt", "2.ckpt", "3.ckpt"]


def test_object_store_paths_are_refused(tmp_path):
    eng = _engine(FileWriter())
    with pytest.raises(ValueError, match="local paths only"):
        eng.save("memory://bucket/x.ckpt", state_fn=lambda: {"lightning": {"files": {}}})
    eng.close()
