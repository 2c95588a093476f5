"""storage: the ``latest`` pointer only moves forward, removal repoints it, staging cleanup."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import logging
import os
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import faultfs
import pytest
import torch
from conftest import Store
from writers import another_writer

from gockpt import storage
from gockpt.errors import CheckpointError, CheckpointStorageError, CheckpointTimeoutError
from gockpt.format import CheckpointCorruptError
from gockpt.load import read_checkpoint
from gockpt.persist import persist
from gockpt.storage import (
    advance_latest,
    claim_directory,
    cleanup_staging,
    is_complete,
    is_local,
    latest_checkpoint,
    remove_checkpoint,
    url_to_fs,
)


@pytest.fixture
def faulty_local(tmp_path, monkeypatch):
    """(store, fault): a local directory behind the fault-injecting filesystem (tests/faultfs.py)."""
    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultLocalFileSystem, "fault", fault)
    return Store(faultfs.local_url(tmp_path / "store"), kind="local"), fault


def pointer(store):
    return json.loads(store.fs.cat_file(store.fs_path("latest")))


def test_url_to_fs_and_is_local(tmp_path):
    fs, path = url_to_fs(str(tmp_path / "x") + "/", None)
    assert is_local(fs) and path == str(tmp_path / "x")
    fs, path = url_to_fs("memory://bucket/dir/", {})
    assert not is_local(fs) and path == "/bucket/dir"


def test_latest_only_moves_forward(store, make_request, make_tensors):
    tensors = make_tensors(1)
    assert latest_checkpoint(store.root) is None
    persist(make_request(store.path("step-10"), tensors, step=10))
    assert latest_checkpoint(store.root) == store.path("step-10")

    persist(make_request(store.path("step-5"), tensors, step=5))
    assert latest_checkpoint(store.root) == store.path("step-10")
    assert pointer(store) == {"name": "step-10", "captured_step": 10, "run": 0}

    persist(make_request(store.path("step-12"), tensors, step=12))
    assert latest_checkpoint(store.root) == store.path("step-12")
    # Re-saving the checkpoint the pointer names updates its step, even downwards.
    persist(make_request(store.path("step-12"), tensors, step=11))
    assert pointer(store) == {"name": "step-12", "captured_step": 11, "run": 0}


def test_latest_moves_past_a_newer_checkpoint_that_is_gone(store, make_request, make_tensors):
    tensors = make_tensors(1)
    persist(make_request(store.path("step-10"), tensors, step=10))
    store.fs.rm(store.fs_path("step-10"), recursive=True)
    assert latest_checkpoint(store.root) is None  # named, but no longer complete
    persist(make_request(store.path("step-3"), tensors, step=3))
    assert latest_checkpoint(store.root) == store.path("step-3")


def test_update_latest_false_leaves_pointer(store, make_request, make_tensors):
    persist(make_request(store.path("a"), make_tensors(1), step=1))
    persist(make_request(store.path("b"), make_tensors(1), step=2, update_latest=False))
    assert latest_checkpoint(store.root) == store.path("a")


def test_remove_checkpoint_repoints_latest(store, make_request, make_tensors):
    tensors = make_tensors(1)
    for name, step in (("s4", 4), ("s9", 9), ("s7", 7)):
        persist(make_request(store.path(name), tensors, step=step))
    assert latest_checkpoint(store.root) == store.path("s9")

    remove_checkpoint(store.path("s9"))
    assert not is_complete(store.path("s9")) and "s9" not in store.listing()
    assert latest_checkpoint(store.root) == store.path("s7")

    remove_checkpoint(store.path("s4"))  # not the latest: pointer unchanged
    assert pointer(store) == {"name": "s7", "captured_step": 7, "run": 0}

    remove_checkpoint(store.path("s7"))
    assert latest_checkpoint(store.root) is None
    assert store.listing() == []
    remove_checkpoint(store.path("s7"))  # already gone: no error


def test_remove_checkpoint_of_a_symlink_keeps_its_target(tmp_path, make_request, make_tensors):
    real = str(tmp_path / "real")
    persist(make_request(real, make_tensors(1), step=1, update_latest=False))
    link = tmp_path / "link"
    link.symlink_to(real)
    remove_checkpoint(str(link))
    assert not os.path.lexists(link)
    read_checkpoint(real)


def test_malformed_pointer_raises_naming_it(store):
    fs = store.fs
    fs.makedirs(store.fs_path(), exist_ok=True)
    for bad in (b"{not json", b'{"name": "../escape", "captured_step": 1}', b'{"name": "x"}'):
        fs.pipe_file(store.fs_path("latest"), bad)
        with pytest.raises(CheckpointCorruptError, match="latest"):
            latest_checkpoint(store.root)


@pytest.mark.parametrize("failure", [TimeoutError("read timed out"),
                                     ConnectionRefusedError(errno.ECONNREFUSED, "refused")])
def test_a_pointer_the_store_fails_to_read_is_a_storage_error_not_a_corrupt_one(
        make_request, make_tensors, monkeypatch, failure):
    # A hung or unreachable object store while reading 'latest': the pointer may be healthy,
    # so it is not reported as damaged (a caller would act on that), but as what it is.
    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    store = Store(faultfs.memory_root(), kind="memory")
    persist(make_request(store.path("s1"), make_tensors(1), step=1))

    def fail_the_pointer(op, path):
        if op == "cat" and path.rstrip("/").endswith("/latest"):
            raise failure

    fault.op_hook = fail_the_pointer
    want = CheckpointTimeoutError if isinstance(failure, TimeoutError) else CheckpointStorageError
    with pytest.raises(want, match="latest") as info:
        latest_checkpoint(store.root)
    assert not isinstance(info.value, CheckpointCorruptError) and info.value.__cause__ is failure
    fault.op_hook = None
    assert latest_checkpoint(store.root) == store.path("s1")


def test_a_store_timing_out_while_a_checkpoint_is_read_raises_a_timeout_error(
        make_request, make_tensors, monkeypatch):
    # An object store's own timeout (botocore's ReadTimeoutError is no OSError nor
    # TimeoutError) reached the caller as it was; it is named as GoCkpt's timeout, the
    # original kept as the cause. The checkpoint reads fine once the store answers.
    from gockpt.load import read_checkpoint

    class ReadTimeoutError(Exception):
        pass

    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    store = Store(faultfs.memory_root(), kind="memory")
    persist(make_request(store.path("s1"), make_tensors(1), step=1))
    failure = ReadTimeoutError("Read timeout on endpoint URL")

    def hang_up(op, path):
        if op == "cat" and not path.endswith("manifest.json"):
            raise failure

    fault.op_hook = hang_up
    with pytest.raises(CheckpointTimeoutError, match="s1") as info:
        read_checkpoint(store.path("s1"))
    assert info.value.__cause__ is failure
    fault.op_hook = None
    assert read_checkpoint(store.path("s1")).tensors


def test_advance_latest_replaces_a_malformed_pointer(store, make_request, make_tensors):
    persist(make_request(store.path("a"), make_tensors(1), step=1, update_latest=False))
    store.fs.pipe_file(store.fs_path("latest"), b"garbage")
    assert advance_latest(store.path("a"), 1)
    assert latest_checkpoint(store.root) == store.path("a")


def _dead_pid() -> int:
    # pids are below pid_max, so pid_max itself never names a process.
    try:
        return int(Path("/proc/sys/kernel/pid_max").read_text())
    except OSError:
        return 2**22


def test_cleanup_staging_removes_only_dead_writers(tmp_path, make_request, make_tensors):
    root = tmp_path / "ckpts"
    root.mkdir()
    dead, alive = _dead_pid(), os.getpid()
    (root / f".ckpt.gockpt-tmp-{dead}-ab12").mkdir()
    (root / f".ckpt.gockpt-tmp-{dead}-ab12" / "shard.safetensors").write_bytes(b"partial")
    (root / f".latest.gockpt-tmp-{dead}-cd34").write_bytes(b"{}")
    (root / f".ckpt.gockpt-tmp-{alive}-ef56").mkdir()
    (root / ".hidden-but-not-ours").mkdir()

    assert cleanup_staging(str(root)) == 2
    assert sorted(os.listdir(root)) == [
        ".ckpt.gockpt-tmp-" + f"{alive}-ef56",
        ".hidden-but-not-ours",
    ]


def test_cleanup_staging_restores_a_checkpoint_moved_aside(tmp_path, make_request, make_tensors):
    root = tmp_path / "ckpts"
    path = str(root / "ckpt")
    persist(make_request(path, make_tensors(1), step=1, update_latest=False))
    # As if the writer died between moving the old checkpoint aside and renaming the new one.
    aside = root / f".ckpt.gockpt-old-{_dead_pid()}-0a0b"
    os.rename(path, aside)

    assert cleanup_staging(str(root)) == 1
    assert sorted(os.listdir(root)) == ["ckpt"]
    read_checkpoint(path)


def test_cleanup_staging_on_object_store_is_a_no_op(make_request, make_tensors):
    assert cleanup_staging("memory://gockpt-nothing-here") == 0


def test_is_complete_needs_the_manifest(store, make_request, make_tensors):
    persist(make_request(store.path("ckpt"), make_tensors(1)))
    assert is_complete(store.path("ckpt"))
    store.fs.rm_file(store.fs_path("ckpt", storage.MANIFEST_NAME))
    assert not is_complete(store.path("ckpt"))
    assert latest_checkpoint(store.root) is None


# --- complete means every file, with its size --------------------------------------------------


def _shard_names(store, name):
    manifest = json.loads(store.fs.cat_file(store.fs_path(name, storage.MANIFEST_NAME)))
    return sorted(n for n in manifest["files"] if n.endswith(".safetensors"))


@pytest.mark.parametrize("damage", ["missing", "truncated"])
def test_a_torn_checkpoint_is_not_complete_and_latest_skips_it(store, make_request, make_tensors, damage):
    persist(make_request(store.path("s1"), make_tensors(1), step=1))
    persist(make_request(store.path("s2"), make_tensors(2), step=2))
    shard = store.fs_path("s2", _shard_names(store, "s2")[-1])
    if damage == "missing":
        store.fs.rm_file(shard)
    else:
        store.fs.pipe_file(shard, store.fs.cat_file(shard)[:-1])
    assert pointer(store)["name"] == "s2"  # the pointer names it, but it is torn

    assert not is_complete(store.path("s2")) and is_complete(store.path("s1"))
    assert latest_checkpoint(store.root) == store.path("s1")
    # A rotation never points 'latest' at it either.
    persist(make_request(store.path("s0"), make_tensors(1), step=0))
    remove_checkpoint(store.path("s1"))
    assert pointer(store)["name"] == "s0"


def test_latest_checkpoint_scans_manifests_without_a_pointer(store, make_request, make_tensors):
    assert latest_checkpoint(store.root) is None
    for name, step in (("b", 7), ("a", 9), ("c", 3)):
        persist(make_request(store.path(name), make_tensors(1), step=step, update_latest=False))
    store.fs.makedirs(store.fs_path(".hidden-scratch"), exist_ok=True)
    assert "latest" not in store.listing()
    assert latest_checkpoint(store.root) == store.path("a")


def test_object_store_removal_deletes_the_manifest_first(make_request, make_tensors, monkeypatch):
    fault = faultfs.Fault()
    monkeypatch.setattr(faultfs.FaultMemoryFileSystem, "fault", fault)
    store = Store(faultfs.memory_root(), kind="memory")
    persist(make_request(store.path("s1"), make_tensors(1), step=1))
    persist(make_request(store.path("s2"), make_tensors(2), step=2))
    root = store.fs_path("s2")

    def crash_after_the_manifest(op, path):
        if op == "rm" and path.rstrip("/").endswith("/s2"):
            raise ConnectionResetError(errno.ECONNRESET, "connection lost", path)

    fault.op_hook = crash_after_the_manifest
    with pytest.raises(CheckpointStorageError, match="s2") as info:
        remove_checkpoint(store.path("s2"))
    assert isinstance(info.value.__cause__, ConnectionResetError)
    fault.op_hook = None
    # What is left is not a checkpoint: no manifest, not complete, not named by 'latest'.
    assert storage.MANIFEST_NAME not in store.listing("s2") and store.fs.exists(root)
    assert not is_complete(store.path("s2"))
    assert latest_checkpoint(store.root) == store.path("s1")


# --- scratch clean-up that trusts locks, not PIDs ------------------------------------------------

HOLD_LOCK = (
    "import fcntl, os, sys\n"
    "d = os.path.isdir(sys.argv[1])\n"
    "fd = os.open(sys.argv[1], os.O_RDONLY if d else os.O_RDWR | os.O_CREAT, 0o644)\n"
    "fcntl.flock(fd, fcntl.LOCK_EX)\n"
    "d or os.write(fd, sys.argv[2].encode())\n"
    "print('locked', flush=True)\n"
    "sys.stdin.read()\n"
)


@contextlib.contextmanager
def lock_held_by_another_process(path, content=""):
    """A process (any PID namespace would do) holding ``flock`` on ``path``; killed on exit."""
    proc = subprocess.Popen([sys.executable, "-c", HOLD_LOCK, str(path), content],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "locked"
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_cleanup_staging_keeps_a_locked_staging_whatever_pid_its_name_has(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    # A dead PID in the name, but its writer (e.g. in another container) holds the lock.
    live = root / f".ckpt.gockpt-tmp-{_dead_pid()}-ab12"
    live.mkdir()
    (live / "shard.safetensors").write_bytes(b"in flight")
    # This process's PID in the name (another namespace reuses numbers), lock free: stale.
    stale = root / f".ckpt.gockpt-tmp-{os.getpid()}-cd34"
    stale.mkdir()
    (stale / storage.STAGING_LOCK_NAME).write_bytes(b"")

    with lock_held_by_another_process(live / storage.STAGING_LOCK_NAME):
        assert cleanup_staging(str(root)) == 1
        assert sorted(os.listdir(root)) == [live.name]
        assert (live / "shard.safetensors").read_bytes() == b"in flight"
    # Its writer died: the kernel dropped the lock, the staging goes.
    assert cleanup_staging(str(root)) == 1
    assert os.listdir(root) == []


def test_cleanup_staging_keeps_unlocked_entries_while_another_writer_owns_the_directory(tmp_path):
    root = tmp_path / "ckpts"
    root.mkdir()
    entry = root / f".latest.gockpt-tmp-{_dead_pid()}-ef56"
    entry.write_bytes(b"{}")
    with lock_held_by_another_process(root):  # another writer's flock on the folder
        assert cleanup_staging(str(root)) == 0
        assert entry.exists()
    assert cleanup_staging(str(root)) == 1
    assert os.listdir(root) == []  # the clean-up's own claim added nothing to the folder


def test_a_staging_directory_is_locked_while_it_is_written(faulty_local, make_request, make_tensors):
    store, fault = faulty_local
    seen = []
    once = threading.Lock()

    def cleanup_from_another_writer(name, nbytes):
        # Mid-write (io threads call this concurrently: the first one checks).
        if once.acquire(blocking=False):
            parent = store.fs_path()
            seen.append(cleanup_staging(parent))
            seen.append(sorted(os.listdir(parent)))
            lock = os.path.join(parent, seen[-1][0], storage.STAGING_LOCK_NAME)
            fd = os.open(lock, os.O_RDWR)
            try:
                with pytest.raises(BlockingIOError):  # held: any process sees a live writer
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            finally:
                os.close(fd)

    fault.hook = cleanup_from_another_writer
    persist(make_request(store.path("ckpt"), make_tensors(1), step=1))
    removed, listing = seen
    assert removed == 0 and len(listing) == 1 and ".gockpt-tmp-" in listing[0]
    assert sorted(os.listdir(store.fs_path())) == ["ckpt", "latest"]
    assert storage.STAGING_LOCK_NAME not in os.listdir(store.fs_path("ckpt"))


# --- one writer per directory ------------------------------------------------------------------


def _has_user_xattrs(path):
    try:
        os.setxattr(path, "user.gockpt.probe", b"1")
        os.removexattr(path, "user.gockpt.probe")
        return True
    except OSError:
        return False


def test_a_second_writer_process_is_refused_and_a_killed_one_does_not_block(tmp_path):
    directory = tmp_path / "ckpts"
    with another_writer(directory) as proc:
        with pytest.raises(CheckpointError) as info:
            claim_directory(str(directory))
        message = str(info.value)
        assert str(directory) in message and info.value.path == str(directory)
        # The owner is named where the filesystem keeps user xattrs (CI machines differ).
        named = _has_user_xattrs(tmp_path)
        owner = f"pid {proc.pid}" if named else "owner unknown"
        assert owner in message
        assert (repr(socket.gethostname()) in message) == named
        # The engine claims the directory of each checkpoint it saves.
        import torch

        import gockpt

        model = torch.nn.Linear(2, 2)
        engine = gockpt.Engine(model, torch.optim.SGD(model.parameters(), lr=0.1),
                               gockpt.GoCkptConfig(mode="sync"))
        try:
            with pytest.raises(CheckpointError, match=owner):
                engine.save(str(directory / "ckpt"))
        finally:
            engine.close()
    # The kernel released the dead writer's lock: a restarted run claims at once.
    claim = claim_directory(str(directory))
    claim.release()
    assert storage.WRITER_LOCK_NAME not in os.listdir(directory)  # the lock is the folder's own


def _holds_flock(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def test_claims_are_per_process_and_reference_counted(tmp_path):
    directory = tmp_path / "ckpts"
    first = claim_directory(str(directory))
    second = claim_directory(str(directory) + "/")  # the same directory, another spelling
    # A new open file description of the folder cannot lock it: this process holds it.
    assert _holds_flock(directory) and os.listdir(directory) == []
    first.release()
    first.release()  # idempotent: does not drop the other engine's claim
    assert _holds_flock(directory)
    with second:
        pass
    assert not _holds_flock(directory)


def test_object_store_claim_refuses_a_renewing_owner_and_takes_over_a_silent_one(caplog):
    root = f"memory://gockpt-claim-{uuid.uuid4().hex}"
    fs, path = url_to_fs(root, None)
    owner_path = f"{path}/{storage.OWNER_OBJECT_NAME}"
    other = {"host": "elsewhere", "pid": 4242, "token": "other", "seq": 0}
    stop = threading.Event()

    def renew():
        while not stop.is_set():
            other["seq"] += 1
            fs.pipe_file(owner_path, json.dumps(other).encode())
            stop.wait(0.02)

    renewer = threading.Thread(target=renew)
    renewer.start()
    try:
        with pytest.raises(CheckpointError, match=r"host 'elsewhere', pid 4242"):
            claim_directory(root, lease_s=0.3)
    finally:
        stop.set()
        renewer.join()
    # It stopped renewing (its process died): taken over after one lease, with a warning.
    with caplog.at_level(logging.WARNING, logger="gockpt"):
        claim = claim_directory(root, lease_s=0.3)
    assert any("taking over" in r.getMessage() for r in caplog.records)
    mine = json.loads(fs.cat_file(owner_path))
    assert mine["token"] == claim.owner["token"] and mine["pid"] == os.getpid()
    deadline = time.monotonic() + 10
    while json.loads(fs.cat_file(owner_path))["seq"] == mine["seq"]:
        assert time.monotonic() < deadline, "the claim is never renewed"
        time.sleep(0.02)
    claim.release()
    assert not fs.exists(owner_path)
    # No claim left: no GoCkpt thread either (harnesses check for leaked threads).
    assert not [t for t in threading.enumerate() if t.name == "gockpt-claims"]


def test_publish_across_devices_copies_with_the_manifest_last(tmp_path, make_request, make_tensors,
                                                               monkeypatch):
    # A checkpoint folder on another device than its staging (overlayfs directories of a lower
    # layer, a bind mount) makes rename fail with EXDEV: the save is published by copy.
    tensors = make_tensors(3)
    root = tmp_path / "ckpts"
    persist(make_request(str(root / "older"), make_tensors(2), step=1))
    real_rename = os.rename
    order = []

    def rename(src, dst, *a, **k):
        if ".gockpt-tmp-" in str(src) and str(dst).endswith("ckpt"):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        return real_rename(src, dst, *a, **k)

    real_copyfile = __import__("shutil").copyfile

    def copyfile(src, dst, *a, **k):
        order.append(os.path.basename(dst))
        return real_copyfile(src, dst, *a, **k)

    monkeypatch.setattr(os, "rename", rename)
    monkeypatch.setattr("shutil.copyfile", copyfile)
    persist(make_request(str(root / "ckpt"), tensors, step=2))
    assert order[-1] == storage.MANIFEST_NAME and len(order) > 1
    assert is_complete(str(root / "ckpt"))
    loaded = read_checkpoint(str(root / "ckpt"))
    assert loaded.extra == {"step": 2}
    for name, t in tensors.items():
        assert torch.equal(loaded.tensors[name], t), name
    assert not [n for n in os.listdir(root) if ".gockpt-" in n]
    assert read_checkpoint(str(root / "older")).extra == {"step": 1}


def test_background_deleter_deletes_small_trees_at_once_and_large_ones_by_drain(tmp_path):
    """A small renamed-aside tree is gone when the call returns; a large one (a sparse file of
    BACKGROUND_DELETE_BYTES: no disk used) is handed to the deleter's thread and gone by drain()."""
    from gockpt.fsutil import BACKGROUND_DELETE_BYTES
    from gockpt.storage import BackgroundDeleter

    small, large = tmp_path / ".small.gockpt-tmp-1-a", tmp_path / ".large.gockpt-tmp-1-b"
    for d in (small, large):
        d.mkdir()
    (small / "x.safetensors").write_bytes(b"x" * 100)
    with open(large / "x.safetensors", "wb") as f:
        f.truncate(BACKGROUND_DELETE_BYTES)
    deleter = BackgroundDeleter()
    deleter(str(small))
    assert not small.exists()
    deleter(str(large))
    deleter.drain()
    assert not large.exists()
    deleter.close()
    assert os.listdir(tmp_path) == []


def test_path_key_names_one_directory_however_it_is_spelled(tmp_path, monkeypatch):
    from gockpt.fsutil import path_key

    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "alias")
    os.symlink(tmp_path / "d" / "real", tmp_path / "d" / "link")  # a checkpoint that is a symlink
    monkeypatch.chdir(tmp_path)
    want = str(tmp_path.resolve() / "d" / "ckpt")
    for spelling in ("d/ckpt", "./d/ckpt", "d/ckpt/", "alias/ckpt", "d/../alias/./ckpt",
                     str(tmp_path / "d" / "ckpt"), f"file://{tmp_path}/d/ckpt"):
        assert path_key(spelling) == want, spelling
    assert path_key("d/link") == str(tmp_path.resolve() / "d" / "link")  # not its target
    assert path_key("d/other") != want
    assert path_key("s3://bucket/run/ckpt/") == "s3://bucket/run/ckpt"  # keys are not resolved
    assert path_key("memory://a/./b") == "memory://a/./b"
    assert path_key(tmp_path / "d" / "ckpt") == want  # an os.PathLike, as Engine.remove takes
    monkeypatch.setenv("HOME", str(tmp_path / "d"))
    assert path_key("~/ckpt") == want  # fsspec expands "~": the home's, not "./~/ckpt"
    assert path_key("./~/ckpt") != want and path_key("./file:/x") != path_key("file:/x")


def test_bounded_calls_from_many_threads_all_run_and_keep_their_own_errors():
    # Every call gets a worker of its own (an idle one, or a new one), whatever the interleaving
    # of callers; a TimeoutError the call itself raises is its own, not "no answer".
    import concurrent.futures
    import random

    from gockpt.fsutil import bounded_call

    def call(i: int) -> int:
        time.sleep(random.random() / 200)
        return i * i

    with concurrent.futures.ThreadPoolExecutor(8) as callers:
        got = list(callers.map(lambda i: bounded_call(lambda: call(i), 10.0, f"call {i}"),
                               range(200)))
    assert got == [i * i for i in range(200)]

    def socket_timeout() -> None:
        raise TimeoutError("read timed out (the socket's own)")

    with pytest.raises(TimeoutError, match="the socket's own"):
        bounded_call(socket_timeout, 10.0, "read")
    with pytest.raises(TimeoutError, match="no answer"):
        bounded_call(lambda: time.sleep(0.3), 0.05, "slow read")
    assert bounded_call(lambda: 7, 10.0, "pointer write", serial=True) == 7
    # No thread is kept once the calls have returned (test suites that police threads, as
    # Lightning's does, see none of GoCkpt's).
    deadline = time.monotonic() + 5
    while [t for t in threading.enumerate() if t.name.startswith("gockpt-storage")]:
        assert time.monotonic() < deadline, threading.enumerate()
        time.sleep(0.01)


@pytest.mark.parametrize("run", [1 << 63, -1, 1.5, True, "7"])
def test_a_manifest_whose_run_is_out_of_range_is_corrupt_and_never_taken_for_the_newest(tmp_path, run):
    # 'run' orders checkpoints of different runs for 'latest': one claiming a run no engine
    # records (past a signed 64-bit integer, negative, not an integer) is refused, not ranked.
    from gockpt.errors import CheckpointCorruptError
    from gockpt.snapshot import save_tree

    save_tree(str(tmp_path / "good"), {"x": torch.ones(2)}, step=1)
    save_tree(str(tmp_path / "odd"), {"x": torch.ones(2)}, step=5, meta={"run": run}, update_latest=False)
    with pytest.raises(CheckpointCorruptError, match="'run'"):
        storage.read_manifest(*storage.url_to_fs(str(tmp_path / "odd"), None))
    os.unlink(tmp_path / "latest")
    assert storage.latest_checkpoint(str(tmp_path)) == str(tmp_path / "good")
