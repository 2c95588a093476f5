"""Where a save may land: a save publishes by replacing its directory whole, so it must never
replace a directory that holds someone's files, and never take a name GoCkpt keeps (the
``latest`` pointer, scratch entries that clean-up deletes)."""

from __future__ import annotations

import contextlib
import os

import pytest
import torch
from _loop import assert_state_equal, make, snapshot, train

import gockpt
from gockpt import Engine, GoCkptConfig
from gockpt.cli import main as cli_main


def _engine(**cfg):
    model, opt, sched, scaler = make("adamw")
    train(model, opt, sched, scaler, 2)
    return Engine(model, opt, GoCkptConfig(**cfg)), (model, opt, sched, scaler)


def _tree(root) -> dict[str, bytes]:
    out = {}
    for d, _, files in os.walk(root):
        for f in files:
            p = os.path.join(d, f)
            with open(p, "rb") as fh:
                out[os.path.relpath(p, root)] = fh.read()
    return out


def test_a_save_never_replaces_a_directory_that_holds_no_checkpoint(tmp_path, monkeypatch):
    eng, (model, opt, *_) = _engine(mode="lazy")
    run = tmp_path / "run"
    first = eng.save(str(run / "step-2")).result()
    user = tmp_path / "project"
    (user / "src").mkdir(parents=True)
    (user / "data.csv").write_text("a,b\n1,2\n")
    before = {p: _tree(p) for p in (run, user)}
    monkeypatch.chdir(user)
    # A user's folder, the working directory, the folder of all checkpoints (a typo).
    for path in (str(user), ".", str(run)):
        with pytest.raises(FileExistsError, match="is not a checkpoint"):
            eng.save(path)
    assert {p: _tree(p) for p in (run, user)} == before
    assert sorted(os.listdir(user)) == ["data.csv", "src"]
    assert gockpt.latest_checkpoint(str(run)) == first.path
    # A folder with a manifest.json of another tool, alone or beside its data; a checkpoint's
    # folder someone added files to (a tokenizer saved beside it).
    (tmp_path / "dataset").mkdir()
    (tmp_path / "dataset" / "manifest.json").write_text('{"audio": "a.wav"}')
    (tmp_path / "lone").mkdir()
    (tmp_path / "lone" / "manifest.json").write_text('{"version": 1}')
    (tmp_path / "dataset" / "a.wav").write_bytes(b"RIFF")
    (run / "step-2" / "tokenizer.json").write_text("{}")
    for path in (tmp_path / "dataset", tmp_path / "lone", run / "step-2"):
        kept = _tree(path)
        with pytest.raises(FileExistsError, match="is not a checkpoint"):
            eng.save(str(path))
        assert _tree(path) == kept
    (run / "step-2" / "tokenizer.json").unlink()
    # What a save may replace: nothing, an empty directory (a placeholder), a file (stock's
    # last.ckpt), a symlink (replaced, its target kept) and a checkpoint.
    (tmp_path / "empty").mkdir()
    (tmp_path / "file.ckpt").write_bytes(b"stock")
    (tmp_path / "target").mkdir()
    (tmp_path / "target" / "keep").write_text("x")
    os.symlink(tmp_path / "target", tmp_path / "link")
    live = snapshot(model, opt)
    # What a crash leaves of a checkpoint: GoCkpt's own files, no manifest.
    (tmp_path / "torn").mkdir()
    (tmp_path / "torn" / "shard-1a2b3c4d-00000-of-00001.safetensors").write_bytes(b"x")
    (tmp_path / "torn" / "state-0123456789ab.pt").write_bytes(b"x")
    for name in ("new", "empty", "file.ckpt", "link", "new", "torn"):
        m = eng.save(str(tmp_path / name)).result()
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live["model"], name)
    assert (tmp_path / "target" / "keep").read_text() == "x"
    eng.close()


def test_a_directory_filled_while_its_save_is_in_flight_is_left_whole(tmp_path):
    # Checked again at the publish: the directory appeared after the request, before the
    # multi-step copy ended. The save fails with the error; nothing is deleted.
    eng, (model, opt, sched, scaler) = _engine(mode="gockpt_o", min_overlap_steps=3,
                                               max_overlap_steps=3)
    path = tmp_path / "out"
    h = eng.save(str(path))
    path.mkdir()
    (path / "notes.txt").write_text("mine")
    with pytest.raises(OSError, match="is not a checkpoint"):
        train(model, opt, sched, scaler, 6, start_iter=2)  # raised at a training hook, or
        h.result()
    with pytest.raises(OSError, match="is not a checkpoint"):
        h.result()
    assert os.listdir(path) == ["notes.txt"] and (path / "notes.txt").read_text() == "mine"
    assert [n for n in os.listdir(tmp_path) if "gockpt" in n] == []  # no scratch left
    eng.close()  # raised once already: not again


def test_names_gockpt_keeps_are_refused_at_the_request(tmp_path):
    eng, _ = _engine(mode="lazy", update_latest=True)
    with pytest.raises(ValueError, match="pointer"):
        eng.save(str(tmp_path / "latest"))
    with pytest.raises(ValueError, match="scratch"):
        eng.save(str(tmp_path / ".ckpt.gockpt-tmp-123-abc"))
    assert os.listdir(tmp_path) == []
    eng.close()


def test_a_checkpoint_named_latest_without_the_pointer_is_found_by_the_scan(tmp_path):
    # With update_latest=False the name is free; latest_checkpoint then scans instead of
    # failing on a "pointer" that is a directory.
    eng, (model, opt, sched, scaler) = _engine(mode="lazy", update_latest=False)
    eng.save(str(tmp_path / "step-2")).result()
    train(model, opt, sched, scaler, 3, start_iter=2)
    eng.step_end()
    m = eng.save(str(tmp_path / "latest")).result()
    eng.close()
    assert gockpt.latest_checkpoint(str(tmp_path)) == m.path
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "latest").write_text("{not json")  # a real broken pointer still raises
    with pytest.raises(gockpt.CheckpointCorruptError):
        gockpt.latest_checkpoint(str(tmp_path / "other"))


def test_the_cli_refuses_to_convert_over_a_directory_of_checkpoints(tmp_path, capsys):
    eng, _ = _engine(mode="lazy")
    ck = eng.save(str(tmp_path / "checkpoints" / "step-2")).result().path
    eng.close()
    (tmp_path / "checkpoints" / "README.txt").write_text("notes")
    before = _tree(tmp_path / "checkpoints")
    out = tmp_path / "plain.pt"
    torch.save({"state_dict": {"w": torch.ones(3)}, "pytorch-lightning_version": "2.6.0",
                "global_step": 2}, out)
    assert cli_main(["convert", str(out), str(tmp_path / "checkpoints"), "--to", "gockpt"]) != 0
    assert "is not a checkpoint" in capsys.readouterr().err
    assert _tree(tmp_path / "checkpoints") == before and gockpt.is_complete(ck)


def test_files_added_to_the_old_folder_during_the_swap_are_kept(tmp_path, caplog):
    # The folder is checked right before the swap; a file put in it after that check would be
    # swapped out with the old checkpoint. The clean-up checks again and keeps such a folder.
    import fsspec

    from gockpt.targets import LocalTarget

    eng, _ = _engine(mode="lazy")
    path = tmp_path / "ck"
    eng.save(str(path)).result()
    eng.close()
    target = LocalTarget(fsspec.filesystem("file"), str(path))
    target.write("a.bin", iter([b"new"]), lambda: None)
    target.prepare(b'{"format": "gockpt"}')
    target.publish(b"")
    old = target.staging  # after the swap: the previous checkpoint
    with open(os.path.join(old, "notes.txt"), "w") as f:
        f.write("mine")
    with caplog.at_level("WARNING", logger="gockpt"):
        target.cleanup(True)
    kept = [n for n in os.listdir(tmp_path) if n.startswith("ck.gockpt-kept-")]
    assert len(kept) == 1 and (tmp_path / kept[0] / "notes.txt").read_text() == "mine"
    assert any("kept" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(path)) == ["a.bin", "manifest.json"]


@pytest.mark.skipif(not hasattr(__import__("ctypes").CDLL(None), "renameat2"),
                    reason="needs renameat2 (Linux, glibc 2.28+)")
def test_a_checkpoint_swapped_in_while_its_path_is_checked_is_not_taken_for_someones_folder(tmp_path):
    """``last.ckpt`` saved at every step: the request of one save checks the path while the
    publish of the save before swaps its new directory in. That look must not read the swap as
    a folder holding another program's ``manifest.json``."""
    import ctypes
    import threading

    from gockpt.fsutil import check_replaceable

    eng, _ = _engine(mode="sync")
    a, b = str(tmp_path / "last.ckpt"), str(tmp_path / "other.ckpt")
    eng.save(a).result()
    eng.save(b).result()
    eng.close()
    libc = ctypes.CDLL(None, use_errno=True)
    stop, swaps = threading.Event(), [0]

    def swap():  # what a publish does (RENAME_EXCHANGE), as fast as it can
        while not stop.is_set():
            assert libc.renameat2(-100, a.encode(), -100, b.encode(), 2) == 0
            swaps[0] += 1

    t = threading.Thread(target=swap)
    t.start()
    refused = []
    try:
        for _ in range(3000):
            try:
                check_replaceable(a)
            except FileExistsError as e:
                refused.append(str(e))
    finally:
        stop.set()
        t.join()
    assert swaps[0] > 100
    assert refused == [], (len(refused), refused[:1])
    (tmp_path / "lone").mkdir()  # and a folder of another program's is still refused
    (tmp_path / "lone" / "manifest.json").write_text('{"version": 1}')
    with pytest.raises(FileExistsError, match="another format"):
        check_replaceable(str(tmp_path / "lone"))


def test_removing_a_checkpoint_that_another_thread_removes_meanwhile_is_no_error(tmp_path):
    """A rotation deleting a cancelled save whose empty placeholder that save's own clean-up
    removes at the same time (Lightning's top-k): the path is gone either way, which is what
    the removal is for."""
    import threading

    from gockpt.fsutil import remove_local_checkpoint

    path = str(tmp_path / "epoch=5-step=87.ckpt")
    stop = threading.Event()

    def churn():  # an empty placeholder made and removed, as fast as it goes
        while not stop.is_set():
            with contextlib.suppress(FileExistsError):
                os.mkdir(path)
            with contextlib.suppress(OSError):
                os.rmdir(path)

    t = threading.Thread(target=churn)
    t.start()
    errors = []
    try:
        for _ in range(5000):
            try:
                remove_local_checkpoint(path)
            except OSError as e:
                errors.append(e)
    finally:
        stop.set()
        t.join()
    assert errors == [], (len(errors), errors[:1])
    assert not any(n.startswith(".") for n in os.listdir(tmp_path))  # nothing left aside


def test_a_sharded_checkpoints_part_markers_do_not_make_its_folder_someone_elses(tmp_path):
    # Sharded checkpoints of earlier releases kept rank-<r>.captured beside their parts, and a
    # crash before a commit leaves them: a save of that path replaces them, as stock would.
    from gockpt.fsutil import check_replaceable

    ck = tmp_path / "last.ckpt"
    (ck / "rank-00000").mkdir(parents=True)
    for name in ("rank-00000.captured", "rank-00001.captured", "rank-00000.sharding.json"):
        (ck / name).write_bytes(b"")
    check_replaceable(str(ck))
    (ck / "rank-00001.captured.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not a checkpoint"):
        check_replaceable(str(ck))
