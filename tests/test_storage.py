"""storage: the ``latest`` pointer only moves forward, removal repoints it, staging cleanup."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from gockpt import storage
from gockpt.format import CheckpointCorruptError
from gockpt.load import read_checkpoint
from gockpt.persist import persist
from gockpt.storage import (
    advance_latest,
    cleanup_staging,
    is_complete,
    is_local,
    latest_checkpoint,
    remove_checkpoint,
    url_to_fs,
)


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
    assert pointer(store) == {"name": "step-10", "captured_step": 10}

    persist(make_request(store.path("step-12"), tensors, step=12))
    assert latest_checkpoint(store.root) == store.path("step-12")
    # Re-saving the checkpoint the pointer names updates its step, even downwards.
    persist(make_request(store.path("step-12"), tensors, step=11))
    assert pointer(store) == {"name": "step-12", "captured_step": 11}


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
    assert pointer(store) == {"name": "s7", "captured_step": 7}

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
