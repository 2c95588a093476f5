"""The staged commit of checkpoints a strategy writes in its own format (DeepSpeed, sharded FSDP).

Driven through :class:`lightning_gockpt.staged.StagedAdapterEngine`'s own interface with a
writer that writes plain files from a background thread, as the strategies' writers do; the
"strategy" is the seam the engine uses of Lightning's (``broadcast``, ``barrier``), for one
process, or over the gloo group of two spawned ranks.
"""

from __future__ import annotations

import os
import re
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch.distributed as dist
from _dist import spawn

from gockpt import GoCkptConfig
from lightning_gockpt.staged import StagedAdapterEngine


class OneProcess:
    def broadcast(self, obj):
        return obj

    def barrier(self, name=None):
        pass


class FileWriter:
    """Writes ``checkpoint["files"]`` into the staging directory on a thread, after ``gate``."""

    framework_names = re.compile(r"[a-z]\.pt|r\d+\.pt")  # the files of its checkpoints

    def __init__(self) -> None:
        self.pool = ThreadPoolExecutor(1)
        self.gate = threading.Event()
        self.gate.set()
        self.fail = False
        self.fail_after = ""  # fail only once this file exists in the staging directory

    def __call__(self, stage: str, checkpoint: dict) -> tuple[Future, int]:
        files = dict(checkpoint["files"])  # taken at the request

        def run() -> int:
            self.gate.wait(30)
            if self.fail:
                for _ in range(1000):  # fail once the other rank's file is in (no race on the abort)
                    if not self.fail_after or os.path.exists(os.path.join(stage, self.fail_after)):
                        break
                    time.sleep(0.01)
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


def test_a_directory_with_other_files_than_the_format_is_refused_and_kept(tmp_path):
    eng = _engine(FileWriter())
    path = tmp_path / "last.ckpt"
    path.mkdir()
    (path / "a.pt").write_bytes(b"stock")  # a checkpoint of the format: replaced
    _request(eng, path, {"a.pt": b"one"}).result(30)
    assert (path / "a.pt").read_bytes() == b"one"
    (path / "notes.txt").write_text("mine")  # not the format's: the save is refused
    with pytest.raises(RuntimeError, match="notes.txt"):
        _request(eng, path, {"a.pt": b"two"})
    assert sorted(os.listdir(path)) == ["a.pt", "notes.txt"] and (path / "a.pt").read_bytes() == b"one"
    eng.close()
    assert _hidden(tmp_path) == []


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


class Ranks:
    """Lightning's strategy seam over the default gloo group of spawned ranks."""

    def broadcast(self, obj):
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def barrier(self, name=None):
        dist.barrier()


def _two_ranks(rank: int, port: int, root: str, scenario: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    writer = FileWriter()
    if scenario == "dies" and rank == 1:
        writer = lambda stage, ck: (Future(), 0)  # noqa: E731 - its files never arrive
    writer_fails = scenario == "fails" and rank == 0
    if writer_fails:
        writer.fail, writer.fail_after = True, "r1.pt"
    # A short wait only where a rank is gone: on a loaded machine a live rank may take longer
    # than a second to mark its files, and rank 0 must not give up on it (and remove the
    # staging directory under it).
    eng = StagedAdapterEngine(Ranks(), GoCkptConfig(), writer, rank=rank, world=2,
                              collective=lambda: True,
                              commit_timeout_s=1.0 if scenario == "dies" else 30.0)
    path = os.path.join(root, "step.ckpt")
    handle = eng.save(path, state_fn=lambda: {"lightning": {"files": {f"r{rank}.pt": b"x"}}})
    if scenario == "dies":
        if rank == 1:
            os._exit(0)  # killed after its request, before its files
        try:
            handle.result(30)
        except TimeoutError as e:
            outcome = f"timeout: {e}"
        else:
            outcome = "published"
    else:
        try:
            handle.result(30)
        except OSError:
            assert writer_fails
        try:
            eng.wait(30)  # collective: no rank may wait for one that raised
            outcome = "no error"
        except BaseException as e:  # noqa: BLE001 - reported to the test
            outcome = f"{type(e).__name__}: {e}"
    with open(os.path.join(root, f"outcome-{rank}"), "w") as f:
        f.write(outcome)
    os._exit(0)


def _port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_a_rank_that_dies_before_its_files_leaves_no_checkpoint(tmp_path):
    """Rank 1 is gone after its request: rank 0 gives up after commit_timeout_s, nothing is
    published at the path and no staging directory is left."""
    spawn(_two_ranks, args=(_port(), str(tmp_path), "dies"), nprocs=2)
    assert (tmp_path / "outcome-0").read_text().startswith("timeout: ")
    assert "rank 1" in (tmp_path / "outcome-0").read_text()
    assert sorted(os.listdir(tmp_path)) == ["outcome-0"]


def test_a_failure_on_one_rank_is_raised_on_every_rank(tmp_path):
    """Rank 0's write fails (disk full): nothing is published, and the collective wait raises on
    both ranks (rank 1 names rank 0's error) instead of leaving one waiting for the other."""
    spawn(_two_ranks, args=(_port(), str(tmp_path), "fails"), nprocs=2)
    assert (tmp_path / "outcome-0").read_text().startswith("OSError: [Errno 28]")
    assert (tmp_path / "outcome-1").read_text().startswith("RuntimeError: gockpt: a checkpoint failed on "
                                                           "another rank: rank 0: OSError")
    assert sorted(os.listdir(tmp_path)) == ["outcome-0", "outcome-1"]


def test_two_ranks_write_one_checkpoint(tmp_path):
    """Both ranks write into rank 0's staging directory (a shared filesystem): the checkpoint
    holds both ranks' files, and both ranks' waits return."""
    spawn(_two_ranks, args=(_port(), str(tmp_path), "shared"), nprocs=2)
    assert sorted(os.listdir(tmp_path / "step.ckpt")) == ["r0.pt", "r1.pt"]
    assert (tmp_path / "outcome-0").read_text() == "no error"
    assert (tmp_path / "outcome-1").read_text() == "no error"


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
