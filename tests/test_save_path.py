"""Where a save may land: a save publishes by replacing its directory whole, so it must never
replace a directory that holds someone's files, and never take a name GoCkpt keeps (the
``latest`` pointer, scratch entries that clean-up deletes)."""

from __future__ import annotations

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
    with pytest.raises(OSError, match="is not a checkpoint"):
        eng.close()  # the failed save's error, once more


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
