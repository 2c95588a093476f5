"""The framework-free parts of a framework-layout writer: gockpt.folder, gockpt.wrapped,
gockpt.options (used by accelerate_gockpt; its tests run them end to end)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

import pytest
import torch

from gockpt import GoCkptConfig
from gockpt.folder import (
    SIDECAR_NAME,
    FolderWriter,
    StagingFolders,
    folder_number,
    latest_numbered,
    read_sidecar,
    stored_once,
)
from gockpt.handle import CheckpointMetrics
from gockpt.layout import build_layout
from gockpt.options import engine_options
from gockpt.wrapped import engine_model
from gockpt.writer import Snapshot


def _snapshot(path: str) -> Snapshot:
    m = CheckpointMetrics(path=path, mode="gockpt", num_overlap_steps=3, requested_step=4, captured_step=6)
    return Snapshot(path=path, model_state_dict={}, optimizer_state_dicts=[], extra=None, metrics=m)


def _dead_pid() -> int:
    proc = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(proc.stdout)


def test_sidecar_names_the_captured_step_and_reads_back_by_format(tmp_path):
    w = FolderWriter(staging=str(tmp_path), sidecar_format="gockpt-test", sidecar_version=2,
                     sidecar_fields={"iteration": 7})
    (tmp_path / SIDECAR_NAME).write_bytes(w.sidecar_file(_snapshot(str(tmp_path))))
    data = read_sidecar(str(tmp_path), "gockpt-test")
    assert data == {"format": "gockpt-test", "version": 2, "iteration": 7, "requested_step": 4,
                    "captured_step": 6, "mode": "gockpt", "num_overlap_steps": 3}
    assert read_sidecar(str(tmp_path), "another-format") is None
    assert read_sidecar(str(tmp_path / "missing"), "gockpt-test") is None
    assert folder_number(str(tmp_path), "gockpt-test", "iteration", from_name=False) == 7


def test_folder_number_falls_back_to_the_name(tmp_path):
    plain = tmp_path / "checkpoint_12"
    plain.mkdir()
    assert folder_number(str(plain), "gockpt-test", "iteration", from_name=True) == 12
    assert folder_number(str(plain), "gockpt-test", "iteration", from_name=False) is None
    (plain / SIDECAR_NAME).write_text(json.dumps({"format": "gockpt-test", "iteration": 3}))
    assert folder_number(str(plain), "gockpt-test", "iteration", from_name=True) == 3


def test_latest_numbered_is_the_highest_number(tmp_path):
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        latest_numbered(str(tmp_path))
    for name in ("checkpoint_2", "checkpoint_10", ".0-checkpoint_11.gockpt-tmp-1-ab", "notes"):
        (tmp_path / name).mkdir()
    assert latest_numbered(str(tmp_path)) == str(tmp_path / "checkpoint_10")


def test_before_publish_waits_for_the_shares(tmp_path):
    stop = []
    w = FolderWriter(staging=str(tmp_path), sidecar_format="f", shares=["rank_1"], timeout_s=30,
                     stopped=lambda: bool(stop))
    (tmp_path / "rank_1").write_bytes(b"x")
    w.before_publish(_snapshot(str(tmp_path)))  # present: returns at once
    w.shares = ["rank_1", "rank_2"]
    stop.append(True)
    with pytest.raises(TimeoutError, match="rank_2"):
        w.before_publish(_snapshot(str(tmp_path)))


def test_after_publish_keeps_the_newest_numbered(tmp_path):
    for i in range(4):
        (tmp_path / f"checkpoint_{i}").mkdir()
    FolderWriter(staging=str(tmp_path), sidecar_format="f").after_publish(_snapshot(str(tmp_path)))
    assert len(os.listdir(tmp_path)) == 4  # no total_limit: all kept
    FolderWriter(staging=str(tmp_path), sidecar_format="f", rotate_root=str(tmp_path),
                 total_limit=2).after_publish(_snapshot(str(tmp_path)))
    assert sorted(os.listdir(tmp_path)) == ["checkpoint_2", "checkpoint_3"]


def test_staging_is_made_beside_the_folder_and_leftovers_cleaned_once(tmp_path):
    root = tmp_path / "checkpoints"
    root.mkdir()
    leftover = root / f".0-checkpoint_1.gockpt-tmp-{_dead_pid()}-0abc"
    leftover.mkdir()
    staging = StagingFolders()
    first = staging.make(str(root / "checkpoint_2"))
    assert os.path.dirname(first) == str(root) and os.path.basename(first).startswith(".0-checkpoint_2.")
    assert os.listdir(first) == [] and not leftover.exists()
    leftover.mkdir()
    staging.make(str(root / "checkpoint_3"))
    assert leftover.exists()  # the parent is cleaned at its first staging only
    assert os.path.isdir(os.path.dirname(staging.make(str(tmp_path / "new" / "ckpt"))))


class _Tied(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(2, 2)
        self.second = torch.nn.Linear(2, 2)
        self.second.weight = self.first.weight


def test_stored_once_keeps_a_tied_weight_under_its_first_name():
    a, b = _Tied(), torch.nn.Linear(2, 3)
    module, key_map = engine_model([a, b], [a, b])
    layout = build_layout(module, [])
    files = stored_once(layout, key_map, 2)
    assert [name for _, name in files[0]] == ["first.weight", "first.bias", "second.bias"]
    assert [name for _, name in files[1]] == ["weight", "bias"]
    assert [entry for entry, _ in files[1]] == ["model.1.weight", "model.1.bias"]


def test_engine_model_finds_a_wrapper_prefix_and_refuses_a_foreign_key():
    inner = torch.nn.Linear(2, 2)
    wrapper = torch.nn.Sequential()
    wrapper.add_module("module", inner)  # DDP's "module." prefix
    module, key_map = engine_model([wrapper], [inner])
    assert module is inner and key_map == {"weight": (0, "module.weight"), "bias": (0, "module.bias")}
    with pytest.raises(ValueError, match="model 0: key 'weight'"):
        engine_model([torch.nn.Sequential(torch.nn.Linear(2, 2))], [inner])  # no tensor shared


def test_engine_options_resolve_arguments_then_environment_then_file_then_defaults(tmp_path, monkeypatch):
    base = engine_options(exclude=("storage_options", "update_latest"))

    @dataclass(kw_only=True)
    class Options(base):  # type: ignore[misc, valid-type]
        own: int | None = None
        config_file: str | None = field(default=None)

        def __post_init__(self):
            self.resolve({"own": 5}, check=self._check)

        def _check(self):
            if self.own < 0:
                raise ValueError(f"own must be >= 0, got {self.own}")

    cfg = tmp_path / "opts.json"
    cfg.write_text(json.dumps({"mode": "lazy", "max_inflight": 3, "own": 2}))
    monkeypatch.setenv("GOCKPT_CONFIG_FILE", str(cfg))
    monkeypatch.setenv("GOCKPT_MAX_INFLIGHT", "4")
    o = Options(mode="sync")
    assert (o.mode, o.max_inflight, o.own) == ("sync", 4, 2)
    assert not hasattr(o, "storage_options") and not hasattr(o, "update_latest")
    config = o.to_config()
    assert isinstance(config, GoCkptConfig) and config.max_inflight == 4
    assert o.engine_config(update_latest=False).update_latest is False
    monkeypatch.delenv("GOCKPT_CONFIG_FILE")
    assert Options().own == 5  # the subclass's default
    monkeypatch.setenv("GOCKPT_OWN", "-1")
    with pytest.raises(ValueError, match="GOCKPT_OWN='-1': own must be >= 0"):
        Options()
    monkeypatch.setenv("GOCKPT_MAX_INFLIGHT", "0")
    monkeypatch.delenv("GOCKPT_OWN")
    with pytest.raises(ValueError, match="GOCKPT_MAX_INFLIGHT='0'.*max_inflight"):
        Options()
