"""Lightning adapter: resume equivalence in every mode, ModelCheckpoint interplay, DDP, metrics.

Resume equivalence: 24 steps uninterrupted (no GoCkpt at all) vs. a run with GoCkpt checkpoints
every 8 steps that stops after step 20, then a fresh Trainer resuming from the checkpoint
requested at step 16 and finishing at step 24. In the multi-step modes that checkpoint holds
step 18 (K = 3); the resumed run must then repeat the reference's batches 18.. exactly.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
from _lightning_train import Crash, CrashAfter, assert_bitwise_equal, fit, results
from lightning.pytorch.callbacks import LearningRateFinder
from lightning.pytorch.loggers import Logger

import gockpt
from gockpt.dcp import load_full
from gockpt.storage import is_complete
from lightning_gockpt import GoCkptCallback, GoCkptIO
from lightning_gockpt.callback import _linking_callback

HERE = Path(__file__).resolve().parent
MODES = ["sync", "async", "lazy", "gockpt", "gockpt_o", "auto"]
_REFERENCES: dict[tuple, dict] = {}


def gockpt_io(mode: str = "gockpt", **kw) -> GoCkptIO:
    """GoCkptIO forcing K = 3 in the multi-step modes, with room for 4 saves in flight.

    The room matters: a request that finds every host slot taken finishes the copies still in
    their windows at once, which would shorten K however slowly the machine persists.
    """
    kw.setdefault("max_inflight", 4)
    return GoCkptIO(mode=mode, min_overlap_steps=3, max_overlap_steps=3, **kw)


def reference(tmp_path_factory, precision: str = "32-true", accumulate: int = 1) -> dict:
    """The uninterrupted 24-step run without GoCkpt (cached per configuration)."""
    key = (precision, accumulate)
    if key not in _REFERENCES:
        root = tmp_path_factory.mktemp("reference")
        _REFERENCES[key] = results(*fit(str(root), precision=precision, accumulate=accumulate))
    return _REFERENCES[key]


def assert_continues_reference(res: dict, ref: dict, captured_step: int, accumulate: int = 1) -> None:
    """The resumed run started at ``captured_step`` and ended exactly as the reference."""
    first = captured_step * accumulate  # batches before the captured step
    assert sorted(res["losses"]) == list(range(first, 24 * accumulate))
    for batch, loss in res["losses"].items():
        assert loss == ref["losses"][batch], f"loss of batch {batch}"
    assert res["global_step"] == ref["global_step"] == 24
    assert_bitwise_equal(res["model"], ref["model"], "model")
    assert_bitwise_equal(res["optim"], ref["optim"], "optimizer")


def scratch_entries(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir() if ".gockpt-" in p.name)


class MemoryLogger(Logger):
    """Keeps every ``log_metrics`` call."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[dict, int | None]] = []

    @property
    def name(self) -> str:
        return "memory"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params, *args, **kwargs) -> None:
        pass

    def log_metrics(self, metrics, step=None) -> None:
        self.calls.append((dict(metrics), step))


# ---------------------------------------------------------------------- resume equivalence

RESUME_CASES = (
    [(mode, "32-true", 1) for mode in MODES]
    + [("gockpt", "bf16-mixed", 1), ("gockpt_o", "bf16-mixed", 1), ("async", "bf16-mixed", 1)]
    + [("gockpt", "32-true", 2), ("gockpt_o", "bf16-mixed", 2), ("lazy", "32-true", 2)]
)


@pytest.mark.parametrize(("mode", "precision", "accumulate"), RESUME_CASES)
def test_resume_after_stop_equals_uninterrupted_run(tmp_path, tmp_path_factory, mode, precision, accumulate):
    ref = reference(tmp_path_factory, precision, accumulate)
    logger = MemoryLogger()
    with pytest.raises(Crash):
        fit(str(tmp_path / "a"), io=gockpt_io(mode, log_metrics=True), ckpt_every=8, precision=precision,
            accumulate=accumulate, callbacks=(CrashAfter(20),), logger=logger)
    path = str(tmp_path / "a" / "step=16.ckpt")
    state = gockpt.load_checkpoint(path)
    captured, replay = state.captured_step, state.manifest["meta"].get("replay")
    if mode in ("gockpt", "gockpt_o"):
        assert captured == 18, replay
    elif mode != "auto":
        assert captured == 16
    assert 16 <= captured <= 18
    # The non-tensor state was taken at the captured step, with the tensors.
    loaded = GoCkptIO().load_checkpoint(path)
    assert loaded["global_step"] == captured
    assert loaded["lr_schedulers"][0]["last_epoch"] == captured
    assert loaded["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == captured * accumulate
    # Both requested checkpoints were logged once durable (the crash flushed the second).
    logged = sorted({int(m["gockpt/captured_step"]) for m, _ in logger.calls if "gockpt/stall_s" in m})
    assert logged[-1] == captured and len(logged) == 2

    trainer, model = fit(str(tmp_path / "b"), io=gockpt_io(mode), ckpt_path=path, precision=precision,
                         accumulate=accumulate)
    assert_continues_reference(results(trainer, model), ref, captured, accumulate)


def test_tiny_llama_resumes_bit_identically(tmp_path):
    sys.path.insert(0, str(HERE.parents[1] / "examples"))
    try:
        from train_lightning import LlamaLM, make_trainer
    finally:
        sys.path.pop(0)

    def run(root, max_steps, ckpt_path=None, crash_after=None):
        module = LlamaLM(preset="tiny", seed=0, lr=3e-3)
        trainer = make_trainer(str(root), max_steps=max_steps, ckpt_every=4, io=gockpt_io("gockpt_o"),
                               callbacks=[CrashAfter(crash_after)] if crash_after else [])
        trainer.fit(module, ckpt_path=ckpt_path)
        return results(trainer, module)

    ref = run(tmp_path / "ref", 12)
    with pytest.raises(Crash):
        run(tmp_path / "a", 12, crash_after=7)
    path = tmp_path / "a" / "step=4.ckpt"
    assert gockpt.load_checkpoint(str(path)).captured_step == 6
    res = run(tmp_path / "b", 12, ckpt_path=str(path))
    assert sorted(res["losses"]) == list(range(6, 12))
    assert all(res["losses"][b] == ref["losses"][b] for b in res["losses"])
    assert_bitwise_equal(res["model"], ref["model"], "model")
    assert_bitwise_equal(res["optim"], ref["optim"], "optimizer")


# ---------------------------------------------------------------------- crash for real

def _run_until_killed(tmp_path: Path, runs: list[dict]) -> None:
    """Start the job in a subprocess, wait for its ``ready`` line, SIGKILL it there."""
    config = tmp_path / "job.json"
    config.write_text(json.dumps(runs))
    proc = subprocess.Popen([sys.executable, str(HERE / "_lightning_train.py"), str(config)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                            text=True, cwd=tmp_path)
    try:
        lines = []
        for line in proc.stdout:
            lines.append(line)
            if line.startswith("ready"):
                break
        assert lines and lines[-1].startswith("ready"), "".join(lines)
        assert proc.poll() is None  # blocked mid-run, with checkpoints in flight
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(60) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.parametrize(("mode", "save_last"), [("gockpt", "link"), ("gockpt_o", True)])
def test_sigkill_then_resume_from_last_equals_uninterrupted_run(tmp_path, tmp_path_factory, mode, save_last):
    ref = reference(tmp_path_factory)
    root = tmp_path / "ckpt"
    # Two saves per request step with save_last=True: room for both steps' saves in flight.
    io_options = {"mode": mode, "min_overlap_steps": 3, "max_overlap_steps": 3, "max_inflight": 4}
    # Checkpoints every 4 steps (10 per epoch); killed at the end of step 17 once step=12.ckpt
    # (holding step 14) is durable, while the step-16 request (to hold step 18) is still being
    # copied. (Step 20 ends an epoch: its checkpoint would hold step 20 exactly.)
    _run_until_killed(tmp_path, [{
        "root": str(root), "io": io_options, "max_steps": 40, "ckpt_every": 4, "save_last": save_last,
        "gate_path": str(root / "step=12.ckpt"), "gate_step": 17}])
    assert not is_complete(str(root / "step=16.ckpt"))
    last = root / "last.ckpt"
    if save_last == "link":
        assert last.is_symlink() and os.readlink(last) == "step=16.ckpt"
        assert last.exists()  # its placeholder keeps it a candidate for ckpt_path="last"
        with pytest.warns(UserWarning, match="newest complete checkpoint"):
            trainer, model = fit(str(root), io=gockpt_io(mode), ckpt_every=4, save_last=save_last,
                                 ckpt_path="last")
    else:
        assert is_complete(str(last))
        trainer, model = fit(str(root), io=gockpt_io(mode), ckpt_every=4, save_last=save_last,
                             ckpt_path="last")
    assert trainer.ckpt_path == str(last)
    assert_continues_reference(results(trainer, model), ref, 14)
    # The dead run's scratch entries and placeholders are gone; every checkpoint is complete.
    assert scratch_entries(root) == []
    names = {p.name for p in root.iterdir()}
    assert names == {"last.ckpt", *(f"step={s}.ckpt" for s in range(4, 25, 4))}
    assert all(is_complete(str(root / n)) for n in names)
    assert GoCkptIO().load_checkpoint(str(last))["global_step"] == 24


def test_last_resolves_to_newest_complete_checkpoint_when_its_target_is_incomplete(tmp_path, tmp_path_factory):
    """The directory a kill leaves with save_last="link": last.ckpt -> an unpublished checkpoint."""
    ref = reference(tmp_path_factory)
    root = tmp_path / "ckpt"
    fit(str(root), io=gockpt_io("lazy"), ckpt_every=8, max_steps=16)
    (root / "step=24.ckpt").mkdir()  # what make_placeholder leaves for an in-flight save
    os.symlink("step=24.ckpt", root / "last.ckpt")
    with pytest.raises(FileNotFoundError):
        GoCkptIO().load_checkpoint(str(root / "step=24.ckpt"))
    # Building the Trainer clears the placeholder and points the dangling link at step 16.
    trainer, model = fit(str(root), io=gockpt_io("lazy"), ckpt_every=8, save_last="link",
                         ckpt_path="last")
    assert_continues_reference(results(trainer, model), ref, 16)
    # At the start of training the stale placeholder was removed and the dangling link pointed at
    # the newest complete checkpoint; step 24 was then saved under its own name.
    assert os.readlink(root / "last.ckpt") == "step=16.ckpt"
    assert all(is_complete(str(p)) for p in root.iterdir() if p.name.endswith(".ckpt"))
    assert is_complete(str(root / "step=24.ckpt"))


@pytest.mark.parametrize("last", ["last", "latest"])
def test_an_empty_last_beside_a_complete_checkpoint_resumes_from_that_checkpoint(tmp_path, tmp_path_factory, last):
    """A kill after a step's checkpoint was published and before the first ``last.ckpt`` was
    leaves ``last.ckpt`` as its request-time placeholder, an empty folder. ``ckpt_path="last"``
    still finds it and resumes from the newest complete checkpoint (stock, whose two saves are
    back to back, would hold both); the placeholder is gone before the run saves, so its next
    ``last.ckpt`` keeps that name (no ``last-v1.ckpt``). The same for a ModelCheckpoint whose
    ``CHECKPOINT_NAME_LAST`` is its own."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    def checkpoints(save_last):
        cb = ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=8, save_top_k=-1,
                             save_last=save_last)
        cb.CHECKPOINT_NAME_LAST = last
        return (cb,)

    ref = reference(tmp_path_factory)
    root = tmp_path / "ckpt"
    fit(str(root), io=gockpt_io("lazy"), callbacks=checkpoints(False), max_steps=16)
    (root / f"{last}.ckpt").mkdir()
    with pytest.warns(UserWarning, match="newest complete checkpoint"):
        trainer, model = fit(str(root), io=gockpt_io("lazy"), callbacks=checkpoints(True),
                             ckpt_path="last")
    assert trainer.ckpt_path == str(root / f"{last}.ckpt")
    assert_continues_reference(results(trainer, model), ref, 16)
    assert sorted(p.name for p in root.iterdir()) == sorted([f"{last}.ckpt", "step=16.ckpt", "step=24.ckpt",
                                                             "step=8.ckpt"])
    assert GoCkptIO().load_checkpoint(str(root / f"{last}.ckpt"))["global_step"] == 24


def test_last_without_any_complete_checkpoint_raises(tmp_path):
    (tmp_path / "step=8.ckpt").mkdir()
    os.symlink("step=8.ckpt", tmp_path / "last.ckpt")
    with pytest.raises(FileNotFoundError, match="holds no complete checkpoint"):
        GoCkptIO().load_checkpoint(str(tmp_path / "last.ckpt"))


# ---------------------------------------------------------------------- ModelCheckpoint interplay

def test_top_1_under_storage_slower_than_the_interval_always_keeps_a_complete_checkpoint(tmp_path, monkeypatch):
    # Every shard write takes 0.25 s while a checkpoint is requested every 2 steps: requests come
    # faster than storage. Cancelling the in-flight candidate at each top-k removal would leave
    # no complete checkpoint at all; instead some complete, and once one is durable one always is.
    import time

    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import Callback

    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault(hook=lambda name, n: time.sleep(0.25)))
    seen: list[int] = []

    class Look(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.append(sum(is_complete(str(p)) for p in tmp_path.glob("*.ckpt")))

    logger = MemoryLogger()
    fit(local_url(tmp_path), io=gockpt_io("gockpt", max_inflight=2, log_metrics=True), ckpt_every=2,
        save_top_k=1, monitor="score", max_steps=20, callbacks=(Look(),), logger=logger)
    first = next(i for i, n in enumerate(seen) if n)
    assert first < len(seen) - 1 and all(n >= 1 for n in seen[first:]), seen
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=20.ckpt"]
    durable = [int(m["gockpt/captured_step"]) for m, _ in logger.calls if "gockpt/stall_s" in m]
    assert len(set(durable)) >= 2 and durable[-1] == 20, durable


def test_top_1_keeps_the_previous_checkpoint_until_the_next_one_is_durable(tmp_path, monkeypatch):
    from faultfs import Fault, FaultLocalFileSystem, local_url

    gate = threading.Event()
    seen: list[tuple[bool, bool]] = []

    def held(name, nbytes):  # the storage holds step=8.ckpt's files until the gate opens
        if "step=8.ckpt" in name:
            assert gate.wait(30)

    class Look(CrashAfter):  # runs before ModelCheckpoint at each batch end
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 11:
                # step=4.ckpt persists in the background, independent of training: wait for it
                # (bounded) rather than assume a disk speed.
                first = next(h for h in trainer.strategy.checkpoint_io._callback._pending
                             if h.path.endswith("step=8.ckpt"))
                for _ in range(300):
                    if is_complete(str(tmp_path / "step=4.ckpt")):
                        break
                    threading.Event().wait(0.1)
                assert not first.done()
                seen.append((is_complete(str(tmp_path / "step=4.ckpt")),
                             is_complete(str(tmp_path / "step=8.ckpt"))))
                gate.set()

    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault(op_hook=lambda op, path: held(path, 0)
                                                             if op == "open" else None))
    fit(local_url(tmp_path), io=gockpt_io("async"), ckpt_every=4, save_top_k=1, max_steps=12,
        callbacks=(Look(10**9),))
    # step=4.ckpt was removed at step 8 by Lightning, but kept while step=8.ckpt was in flight.
    assert seen == [(True, False)]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step=12.ckpt"]


def test_save_last_true_replaces_last_atomically_and_never_writes_through_a_link(tmp_path):
    other = tmp_path / "elsewhere"
    other.mkdir()
    (other / "keep.txt").write_text("untouched")
    os.symlink(other, tmp_path / "last.ckpt")
    # Every step re-saves last.ckpt while earlier saves of it are still in flight (K = 3).
    trainer, model = fit(str(tmp_path), io=gockpt_io("gockpt"), ckpt_every=1, save_top_k=0, save_last=True,
                         max_steps=12, checkpoint_kwargs={"enable_version_counter": False})
    assert sorted(p.name for p in other.iterdir()) == ["keep.txt"]
    assert (other / "keep.txt").read_text() == "untouched"
    last = tmp_path / "last.ckpt"
    assert last.is_dir() and not last.is_symlink()
    assert scratch_entries(tmp_path) == []
    loaded = GoCkptIO().load_checkpoint(str(last))
    assert loaded["global_step"] == 12
    assert_bitwise_equal(loaded["state_dict"], results(trainer, model)["model"], "model")
    assert_bitwise_equal(loaded["optimizer_states"][0], results(trainer, model)["optim"], "optimizer")


def test_save_last_link_points_at_complete_checkpoints(tmp_path):
    seen: list[tuple[int, bool, bool]] = []

    class Probe(CrashAfter):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            last = tmp_path / "last.ckpt"
            if last.is_symlink():
                seen.append((trainer.global_step, last.exists(), is_complete(str(last))))

    fit(str(tmp_path), io=gockpt_io("gockpt", exact_monitored=False), ckpt_every=4, save_top_k=2,
        monitor="score", save_last="link", max_steps=16, callbacks=(Probe(10**9),))
    # One step after a request the link's target is being copied (K = 3): it is present (its
    # placeholder), not complete.
    assert (5, True, False) in seen and (9, True, False) in seen
    assert all(exists for _, exists, _ in seen)
    assert os.readlink(tmp_path / "last.ckpt") == "step=16.ckpt"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["last.ckpt", "step=12.ckpt", "step=16.ckpt"]
    assert all(is_complete(str(tmp_path / n)) for n in ("step=12.ckpt", "step=16.ckpt", "last.ckpt"))


@pytest.mark.parametrize("exact_monitored", [True, False])
def test_monitored_checkpoints_hold_the_requested_step(tmp_path, exact_monitored):
    states: dict[int, dict] = {}

    class Record(CrashAfter):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            states[trainer.global_step] = {k: v.clone() for k, v in pl_module.state_dict().items()}

    from lightning.pytorch.callbacks import ModelCheckpoint

    unranked = ModelCheckpoint(dirpath=str(tmp_path / "plain"), filename="{step}", every_n_train_steps=6,
                               save_top_k=-1)
    io = gockpt_io("gockpt", exact_monitored=exact_monitored)  # 2 saves a step
    fit(str(tmp_path / "ranked"), io=io, ckpt_every=6,
        monitor="score", max_steps=20, callbacks=(Record(10**9), unranked))
    for step in (6, 12, 18):
        ranked = gockpt.load_checkpoint(str(tmp_path / "ranked" / f"step={step}.ckpt"))
        plain = gockpt.load_checkpoint(str(tmp_path / "plain" / f"step={step}.ckpt"))
        assert ranked.captured_step == (step if exact_monitored else step + 2)
        # An exact save shares its snapshot with the plain save of its step.
        assert plain.captured_step == (step if exact_monitored else step + 2)
        for state in (ranked, plain):
            assert_bitwise_equal(state.model_state_dict, states[state.captured_step], f"step {step}")
            assert state.extra["lightning"]["global_step"] == state.captured_step


# ---------------------------------------------------------------------- lifecycle, wiring, errors

def test_restart_after_a_kill_before_the_first_durable_checkpoint_starts_fresh(tmp_path, tmp_path_factory):
    """What a kill before any checkpoint was durable leaves: placeholders only. Stock starts over."""
    ref = reference(tmp_path_factory)
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "step=8.ckpt").mkdir()
    os.symlink("step=8.ckpt", root / "last.ckpt")
    with pytest.warns(UserWarning, match="no last checkpoint available"):
        trainer, model = fit(str(root), io=gockpt_io("lazy"), ckpt_every=8, save_last="link",
                             ckpt_path="last")
    assert_bitwise_equal(results(trainer, model)["model"], ref["model"], "model")
    assert os.readlink(root / "last.ckpt") == "step=24.ckpt"


def test_entry_point_adds_nothing_to_trainers_without_gockptio(tmp_path, caplog):
    import copy
    import pickle

    import lightning.pytorch as pl

    with caplog.at_level("INFO"):
        plain = pl.Trainer(default_root_dir=tmp_path, logger=False)
    assert not [cb for cb in plain.callbacks if isinstance(cb, GoCkptCallback)]
    assert "gockpt" not in caplog.text.lower()
    ours = pl.Trainer(default_root_dir=tmp_path, logger=False, plugins=[GoCkptIO()])
    cbs = [cb for cb in ours.callbacks if isinstance(cb, GoCkptCallback)]
    assert len(cbs) == 1 and cbs[0]._from_factory
    # Copies (ddp_spawn pickles the trainer's callbacks; tools deep-copy them) are unlinked.
    trainer, _ = fit(str(tmp_path), io=gockpt_io("lazy"), ckpt_every=2, max_steps=2)
    for copied in (copy.deepcopy(trainer.callbacks), pickle.loads(pickle.dumps(trainer.callbacks))):
        cb = next(cb for cb in copied if isinstance(cb, GoCkptCallback))
        assert cb.io is None and cb.engine is None and cb._from_factory


def test_explicit_callback_links_instead_of_the_factory_one(tmp_path):
    explicit = GoCkptCallback()
    io = gockpt_io("async")
    trainer, _ = fit(str(tmp_path), io=io, ckpt_every=2, max_steps=4, callbacks=(explicit,))
    assert _linking_callback(trainer) is explicit and io._callback is explicit
    assert not [cb for cb in trainer.callbacks if isinstance(cb, GoCkptCallback) and cb._from_factory]
    assert is_complete(str(tmp_path / "step=4.ckpt"))


def test_fit_returns_with_every_checkpoint_durable_and_save_after_fit_works(tmp_path, monkeypatch):
    from faultfs import Fault, FaultLocalFileSystem, local_url

    gate = threading.Event()
    paths = [str(tmp_path / f"step={s}.ckpt") for s in (3, 6, 9)]
    complete_at_train_end: list[bool] = []

    def held(op, path):  # the storage holds every file until the gate opens
        if op == "open":
            assert gate.wait(30)

    class OpenGateAtTrainEnd(CrashAfter):  # at the last batch end, every save is still held
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 10:
                complete_at_train_end.extend(is_complete(p) for p in paths)
                gate.set()

    monkeypatch.setattr(FaultLocalFileSystem, "fault", Fault(op_hook=held))
    trainer, model = fit(local_url(tmp_path), io=gockpt_io("gockpt_o", max_inflight=3, host_buffer_bytes=1 << 20), ckpt_every=3, max_steps=10,
                         callbacks=(OpenGateAtTrainEnd(10**9),))
    assert complete_at_train_end == [False, False, False]
    assert all(is_complete(p) for p in paths)
    trainer.save_checkpoint(str(tmp_path / "after.ckpt"))  # the engine is closed: a blocking save
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "after.ckpt"))
    assert loaded["global_step"] == 10
    assert_bitwise_equal(loaded["state_dict"], results(trainer, model)["model"], "model")


def test_metrics_reach_the_logger_per_checkpoint(tmp_path):
    logger = MemoryLogger()
    trainer, _ = fit(str(tmp_path), io=gockpt_io("gockpt", log_metrics=True), ckpt_every=5, max_steps=12,
                     logger=logger)
    steps = [step for _, step in logger.calls]
    assert steps == sorted(steps)  # loggers need non-decreasing steps
    ours = [(m, step) for m, step in logger.calls if "gockpt/stall_s" in m]
    # One logger call per save, in the order they became durable, which storage decides.
    assert sorted(m["gockpt/requested_step"] for m, _ in ours) == [5, 10]
    # Sent beside Lightning's own metrics, not through them: callback_metrics stay stock's.
    assert not [k for k in trainer.callback_metrics if k.startswith("gockpt/")]
    assert all(set(m) <= {k for k in m if k.startswith("gockpt/")} for m, _ in ours)
    # Step 10 ends the epoch (10 batches): that checkpoint must not cross it, so it holds step 10.
    expect = {5: ("gockpt", 3), 10: ("lazy", 1)}
    for m, step in ours:
        mode, k = expect[int(m["gockpt/requested_step"])]
        assert m["gockpt/mode"] == gockpt.MODES.index(mode) and m["gockpt/num_overlap_steps"] == k
        assert m["gockpt/captured_step"] == m["gockpt/requested_step"] + k - 1 <= step
        assert m["gockpt/bytes"] > 0 and m["gockpt/stall_s"] >= 0 and m["gockpt/gbps"] > 0
        assert m["gockpt/time_to_durable_s"] > 0
        # Every tensor copied and written (frozen_copy="always"); no device on the CPU.
        assert m["gockpt/unchanged_bytes"] == m["gockpt/linked_bytes"] == m["gockpt/device_wait_s"] == 0


def test_loggers_get_only_the_runs_own_metrics_by_default(tmp_path):
    logger, stock = MemoryLogger(), MemoryLogger()
    fit(str(tmp_path / "a"), io=gockpt_io("gockpt"), ckpt_every=5, max_steps=12, logger=logger)
    fit(str(tmp_path / "b"), ckpt_every=5, max_steps=12, logger=stock)
    assert [(sorted(m), step) for m, step in logger.calls] == [(sorted(m), step) for m, step in stock.calls]


def test_metrics_of_a_save_wait_for_a_step_that_logs(tmp_path):
    """With ``log_every_n_steps``, a durable save's metrics go out with the next step Lightning
    logs at, never between (loggers see GoCkpt's metrics at the steps they see the run's)."""
    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import ModelCheckpoint

    logger = MemoryLogger()
    pl.seed_everything(0, verbose=False)
    trainer = pl.Trainer(
        default_root_dir=tmp_path, max_steps=20, accelerator="cpu", limit_val_batches=0, logger=logger,
        callbacks=[ModelCheckpoint(dirpath=tmp_path, filename="{step}", every_n_train_steps=3,
                                   save_top_k=-1)],
        enable_progress_bar=False, enable_model_summary=False, log_every_n_steps=4,
        plugins=[gockpt_io("lazy", log_metrics=True)])
    trainer.fit(TinyNet())
    run_steps = {step for m, step in logger.calls if "gockpt/stall_s" not in m}
    ours = [(m, step) for m, step in logger.calls if "gockpt/stall_s" in m]
    assert sorted(m["gockpt/requested_step"] for m, _ in ours) == [3, 6, 9, 12, 15, 18]
    last = trainer.fit_loop.epoch_loop._batches_that_stepped
    for m, step in ours:
        assert step in run_steps or step == last  # a logging step, or the run's end
        assert step >= m["gockpt/captured_step"]  # after it was durable, never back in time
    steps = [step for _, step in logger.calls]
    assert steps == sorted(steps)


def test_resumed_run_ranks_its_checkpoints_above_the_ones_it_resumed_from(tmp_path):
    fit(str(tmp_path), io=gockpt_io("lazy"), ckpt_every=8, max_steps=16)
    fit(str(tmp_path), io=gockpt_io("lazy"), ckpt_every=4, max_steps=20,
        ckpt_path=str(tmp_path / "step=16.ckpt"))
    assert gockpt.latest_checkpoint(str(tmp_path)) == str(tmp_path / "step=20.ckpt")
    assert gockpt.load_checkpoint(str(tmp_path / "step=20.ckpt")).captured_step == 20


@pytest.mark.parametrize("name", ["step=4.ckpt", "last.ckpt"])
@pytest.mark.parametrize("damage", ["fifo", "symlink", "truncated", "duplicate_manifest_key"])
def test_a_damaged_checkpoint_is_refused_naming_the_file_not_taken_for_an_incomplete_one(
        tmp_path, name, damage):
    # Its manifest is written last: a checkpoint that has one is damaged, not cut short. It is
    # refused naming what is wrong, and last.ckpt is not silently swapped for an older one.
    fit(str(tmp_path), io=gockpt_io("sync"), ckpt_every=4, max_steps=8, save_last=True)
    ckpt = tmp_path / name
    shard = next(p for p in ckpt.iterdir() if p.name.endswith(".safetensors"))
    if damage == "fifo":
        shard.unlink()
        os.mkfifo(shard)
        match = shard.name
    elif damage == "symlink":
        shard.unlink()
        shard.symlink_to("/etc/passwd")
        match = shard.name
    elif damage == "truncated":
        with open(shard, "r+b") as f:
            f.truncate(shard.stat().st_size - 1)
        match = shard.name
    else:
        manifest = ckpt / "manifest.json"
        text = manifest.read_text()
        manifest.write_text(text.replace("{", '{"format": 0, ', 1))
        match = "duplicate"
    with pytest.raises(gockpt.CheckpointCorruptError, match=match):
        GoCkptIO().load_checkpoint(str(ckpt))


def test_hyperparameters_needing_pickle_load_only_when_allowed(tmp_path):
    from fractions import Fraction

    import lightning.pytorch as pl
    from _lightning_train import TinyNet

    pl.seed_everything(0, verbose=False)
    model = TinyNet(lr=Fraction(1, 20))  # an object torch.load(weights_only=True) refuses
    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=2, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, plugins=[gockpt_io("sync")])
    trainer.fit(model)
    trainer.save_checkpoint(str(tmp_path / "hp.ckpt"))
    with pytest.raises(gockpt.CheckpointCorruptError, match="allow_pickle"):
        GoCkptIO().load_checkpoint(str(tmp_path / "hp.ckpt"))
    assert GoCkptIO().load_checkpoint(str(tmp_path / "hp.ckpt"), weights_only=False)["hyper_parameters"] == {
        "lr": Fraction(1, 20)}
    assert GoCkptIO(allow_pickle=True).load_checkpoint(str(tmp_path / "hp.ckpt"))["global_step"] == 2


def test_deepspeed_host_copy_engine_keeps_the_state_of_the_call():
    """DeepSpeed's files are copied at the call: later changes to the live tensors and objects
    do not reach them; a save outside a GoCkpt request is refused rather than written unseen."""
    from lightning_gockpt.deepspeed import HostCopyEngine

    class Scaler:  # a live object DeepSpeed passes along (its loss scaler)
        def __init__(self) -> None:
            self.scale = 1.0

    eng = HostCopyEngine()
    with pytest.raises(RuntimeError, match="inside a GoCkpt request"):
        eng.save({"w": torch.ones(2)}, "x.pt")
    w, scaler = torch.arange(6.0), Scaler()
    view = w[2:4]
    eng.begin()
    eng.save({"w": w, "view": view, "scaler": scaler, "groups": [w]}, "a.pt")
    w.add_(10)
    scaler.scale = 2.0
    (path, tree), = eng.end()
    assert path == "a.pt"
    assert torch.equal(tree["w"], torch.arange(6.0)) and torch.equal(tree["view"], torch.tensor([2.0, 3.0]))
    assert tree["view"].untyped_storage().nbytes() == 8  # its own storage: the file holds the view only
    assert tree["scaler"].scale == 1.0 and tree["groups"][0] is not w
    assert eng.state_bytes == (6 + 2 + 6) * 4
    assert eng.preserves_storage_sharing() is False and not eng.is_decoupled()


def test_storage_options_per_save_are_rejected(tmp_path):
    io = GoCkptIO()
    with pytest.raises(TypeError, match="storage_options"):
        io.save_checkpoint({}, str(tmp_path / "x.ckpt"), storage_options={"a": 1})
    # Outside fit (no Trainer at all here) a save is blocking and complete when it returns.
    w = torch.arange(6.0).reshape(2, 3).t()  # non-contiguous: loads with its strides
    io.save_checkpoint({"global_step": 3, "state_dict": {"w": w}}, str(tmp_path / "x.ckpt"))
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "x.ckpt"))
    assert loaded["global_step"] == 3 and torch.equal(loaded["state_dict"]["w"], w)
    assert loaded["state_dict"]["w"].stride() == w.stride()
    with pytest.raises(TypeError):
        GoCkptIO(gockpt.GoCkptConfig(), mode="sync")


def test_weights_only_checkpoint_has_no_optimizer_states(tmp_path):
    trainer, model = fit(str(tmp_path), io=gockpt_io("gockpt"), ckpt_every=6, max_steps=6,
                         checkpoint_kwargs={"save_weights_only": True})
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "step=6.ckpt"))
    assert "optimizer_states" not in loaded and "lr_schedulers" not in loaded
    assert_bitwise_equal(loaded["state_dict"], results(trainer, model)["model"], "model")


# ---------------------------------------------------------------------- DDP, the example

def test_ddp_two_processes_checkpoint_and_resume(tmp_path):
    io_options = {"mode": "gockpt", "min_overlap_steps": 3, "max_overlap_steps": 3}
    common = {"io": io_options, "max_steps": 12, "strategy": "ddp", "devices": 2}
    runs = [
        {**common, "root": str(tmp_path / "a"), "ckpt_every": 6, "results_path": str(tmp_path / "a.pt")},
        {**common, "root": str(tmp_path / "b"), "ckpt_path": str(tmp_path / "a" / "step=6.ckpt"),
         "results_path": str(tmp_path / "b.pt")},
    ]
    config = tmp_path / "job.json"
    config.write_text(json.dumps(runs))
    proc = subprocess.run([sys.executable, str(HERE / "_lightning_train.py"), str(config)], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    uninterrupted = torch.load(tmp_path / "a.pt", weights_only=False)
    resumed = torch.load(tmp_path / "b.pt", weights_only=False)
    # The two ranks shared the write: one part each, committed as one checkpoint.
    assert load_full(str(tmp_path / "a" / "step=6.ckpt")).captured_step == 8
    assert sorted(p.name for p in (tmp_path / "a" / "step=6.ckpt").glob("rank-*[0-9]")) == [
        "rank-00000", "rank-00001"]
    assert sorted(resumed["losses"]) == [8, 9, 10, 11]
    assert all(resumed["losses"][b] == uninterrupted["losses"][b] for b in resumed["losses"])
    assert_bitwise_equal(resumed["model"], uninterrupted["model"], "model")
    assert_bitwise_equal(resumed["optim"], uninterrupted["optim"], "optimizer")
    # One checkpoint per request.
    assert sorted(p.name for p in (tmp_path / "a").iterdir()) == ["step=12.ckpt", "step=6.ckpt"]



def test_example_demo_kills_resumes_and_continues(tmp_path):
    script = HERE.parents[1] / "examples" / "train_lightning.py"
    proc = subprocess.run(
        [sys.executable, str(script), "--demo", "--preset", "tiny", "--max-steps", "80", "--ckpt-every", "20",
         "--root", str(tmp_path / "demo")], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "killed with SIGKILL after step 61" in out
    assert "resuming from" in proc.stderr and "step=40.ckpt" in proc.stderr  # last.ckpt was in flight
    assert "the resumed run restarted after step 42 and trained steps 43..61 again" in out
    assert "identical on all 19 steps" in out


# ---------------------------------------------------------------------- Ctrl-C

CTRL_C_JOB = """
import signal, sys, time
import faultfs
from _lightning_train import fit
from lightning_gockpt import GoCkptIO

root, mode = sys.argv[1], sys.argv[2]
saves = []
# A suite started in the background by a shell without job control runs with SIGINT ignored,
# which this process would inherit: Ctrl-C must reach it as in a terminal.
signal.signal(signal.SIGINT, signal.default_int_handler)

def announce(op, path):
    # The second checkpoint's first shard tells the parent to press Ctrl-C, then stalls: the
    # interrupt lands while that save is being written.
    if op == "open" and "step=8" in path and ".safetensors" in path and not saves:
        saves.append(path)
        print("saving", flush=True)
        time.sleep(1.5)

faultfs.FaultLocalFileSystem.fault = faultfs.Fault(op_hook=announce)
fit(faultfs.local_url(root), io=GoCkptIO(mode=mode), ckpt_every=4, max_steps=10**6)
"""


@pytest.mark.parametrize("mode", ["sync", "gockpt"])
def test_ctrl_c_during_a_save_keeps_every_complete_checkpoint(tmp_path, mode):
    """SIGINT while a checkpoint is being written (on the training thread in ``sync``, in the
    background otherwise): Lightning's graceful shutdown runs, the interrupted save is either
    finished or leaves nothing (no empty folder, no placeholder), older checkpoints stay, and no
    GoCkpt error replaces the interrupt."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(HERE.parent), str(HERE.parent.parent)])}
    root = tmp_path / "ckpt"
    proc = subprocess.Popen([sys.executable, "-c", CTRL_C_JOB, str(root), mode], env=env, cwd=tmp_path,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "saving"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 1, err  # Lightning's exit after a graceful shutdown
    assert "CheckpointError" not in err and "background checkpoint failed" not in err, err
    entries = sorted(p.name for p in root.iterdir())
    assert "step=4.ckpt" in entries, entries
    assert not [n for n in entries if n.startswith(".")], entries  # no staging left behind
    for name in entries:
        assert gockpt.is_complete(str(root / name)), (name, entries)
    loaded = GoCkptIO().load_checkpoint(str(root / "step=4.ckpt"))
    assert loaded["global_step"] == 4


# ---------------------------------------------------------------------- Lightning's tuner


class _FindLrAtEpochStarts(LearningRateFinder):
    """Lightning's learning-rate finder run mid-fit, at the start of epochs 0 and 1: it saves a
    checkpoint, trains with ``trainer.callbacks`` swapped out, restores it and removes it."""

    def __init__(self) -> None:
        super().__init__(num_training_steps=6, early_stop_threshold=None, update_attr=False)

    def on_fit_start(self, trainer, pl_module) -> None:
        pass

    def on_train_epoch_start(self, trainer, pl_module) -> None:
        if trainer.current_epoch in (0, 1):
            self.lr_find(trainer, pl_module)


@pytest.mark.parametrize("mode", ["lazy", "gockpt_o"])
def test_learning_rate_finder_mid_fit_restores_its_checkpoint_as_stock(tmp_path, mode):
    ref = results(*fit(str(tmp_path / "stock"), ckpt_every=4, callbacks=(_FindLrAtEpochStarts(),)))
    got = results(*fit(str(tmp_path / "g"), io=gockpt_io(mode), ckpt_every=4,
                       callbacks=(_FindLrAtEpochStarts(),)))
    assert got["losses"] == ref["losses"]
    assert got["global_step"] == ref["global_step"] == 24
    assert_bitwise_equal(got["model"], ref["model"], "model")
    assert_bitwise_equal(got["optim"], ref["optim"], "optimizer")
    assert not [p.name for p in (tmp_path / "g").iterdir() if p.name.startswith(".lr_find")]


def test_a_run_leaves_trainer_callbacks_as_it_found_them(tmp_path):
    import lightning.pytorch as pl
    from _lightning_train import Batches, TinyNet
    from lightning.pytorch.callbacks import ModelCheckpoint, Timer

    trainer = pl.Trainer(default_root_dir=tmp_path, max_steps=4, accelerator="cpu", logger=False,
                         enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Timer(), ModelCheckpoint(dirpath=tmp_path, every_n_train_steps=2)],
                         plugins=[gockpt_io("lazy")])
    before = list(trainer.callbacks)
    assert [type(cb) for cb in before].index(GoCkptCallback) > 0  # not where the run wants it
    trainer.fit(TinyNet(), train_dataloaders=Batches())
    assert [id(cb) for cb in trainer.callbacks] == [id(cb) for cb in before]
    assert is_complete(str(tmp_path / "epoch=0-step=4.ckpt"))


def test_a_load_right_after_a_save_waits_for_it_whatever_the_path_spelling(tmp_path):
    # The same file saved twice; the second save is still in its copy windows when the script
    # loads it through another spelling of the path. The load must read the second save, not
    # the first one the directory still holds.
    from lightning.pytorch.callbacks import Callback

    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "alias")
    seen = {}

    class SaveThenLoad(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            path = str(tmp_path / "d" / "x.ckpt")
            if batch_idx == 2:
                trainer.save_checkpoint(path)
            if batch_idx == 6:
                trainer.save_checkpoint(path)
                seen["requested"] = trainer.global_step
                other = str(tmp_path / "alias" / "." / "x.ckpt")
                seen["loaded"] = trainer.strategy.checkpoint_io.load_checkpoint(other)["global_step"]

    fit(str(tmp_path), io=gockpt_io("gockpt"), max_steps=9, callbacks=(SaveThenLoad(),))
    assert seen["loaded"] == seen["requested"] == 7
    assert GoCkptIO().load_checkpoint(str(tmp_path / "d" / "x.ckpt"))["global_step"] == 7


def test_removing_the_newest_checkpoint_by_another_spelling_keeps_it_while_the_run_goes_on(tmp_path):
    # A removal of the only checkpoint while its save is in flight is deferred until a newer
    # checkpoint is durable; none comes, so it stays while the run goes on (a crash finds it),
    # and is removed once the run has ended, as stock removes it. Spelled otherwise, the save
    # of the same file is not "a newer checkpoint" whose durability would allow the removal.
    from lightning.pytorch.callbacks import Callback

    (tmp_path / "d").mkdir()
    os.symlink(tmp_path / "d", tmp_path / "alias")
    held = []

    class SaveThenRemove(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if batch_idx == 2:
                trainer.save_checkpoint(str(tmp_path / "d" / "x.ckpt"))
                trainer.strategy.remove_checkpoint(str(tmp_path / "alias" / "x.ckpt"))
            if batch_idx == 8:  # the last batch end: kept, durable once its persist ends
                import time

                path = str(tmp_path / "d" / "x.ckpt")
                deadline = time.monotonic() + 20  # a loaded machine persists slower than 3 steps
                while not is_complete(path) and time.monotonic() < deadline:
                    time.sleep(0.01)
                held.append(GoCkptIO().load_checkpoint(path)["global_step"] if is_complete(path) else None)

    fit(str(tmp_path), io=gockpt_io("gockpt"), max_steps=9, callbacks=(SaveThenRemove(),))
    # Requested at step 3 with K = 3: it holds step 5.
    assert held == [5]
    assert not (tmp_path / "d" / "x.ckpt").exists()


@pytest.mark.parametrize("mode", ["auto", "async"])
def test_removing_a_checkpoint_whose_save_is_in_flight_removes_it_when_nothing_else_is_saved(tmp_path, mode):
    """``save_checkpoint(p)`` then ``remove_checkpoint(p)`` in one batch end, nothing else saved:
    stock leaves nothing; the removal waits for p's own save and then removes it."""
    import lightning.pytorch as pl

    class SaveThenRemove(pl.Callback):
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step == 5:
                p = str(tmp_path / "x.ckpt")
                trainer.save_checkpoint(p)
                trainer.strategy.remove_checkpoint(p)

    io = GoCkptIO() if mode == "auto" else GoCkptIO(mode=mode)
    fit(str(tmp_path / "run"), io=io, max_steps=8, callbacks=(SaveThenRemove(),))
    assert not (tmp_path / "x.ckpt").exists()


def test_a_rotation_is_released_only_by_a_newer_checkpoint_of_its_own_folder(tmp_path):
    """Two top-1 ModelCheckpoints, folder A on slow storage (each write held 50 ms, through a
    faulty fsspec filesystem) and folder B on plain disk: B's checkpoint becoming durable must
    not release the removal of A's previous one while A's newer one is still being written.
    At every batch end A holds a complete checkpoint (what a crash there would find)."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    FaultLocalFileSystem.fault = Fault(hook=lambda name, nbytes: time.sleep(0.05))
    gaps, seen = [], []

    class Look(pl.Callback):  # after both ModelCheckpoints (callbacks' order)
        def on_train_batch_end(self, trainer, *args):
            complete = gockpt.latest_checkpoint(str(tmp_path / "a")) is not None
            if seen and not complete:  # A had a complete checkpoint, and has none now
                gaps.append(trainer.global_step)
            if complete:
                seen.append(trainer.global_step)

    a = ModelCheckpoint(dirpath=local_url(tmp_path / "a"), filename="{step}", every_n_train_steps=1, save_top_k=1)
    b = ModelCheckpoint(dirpath=str(tmp_path / "b"), filename="{step}", every_n_train_steps=1, save_top_k=1, mode="max",
                        save_weights_only=True)
    try:
        fit(str(tmp_path / "run"), io=GoCkptIO(max_inflight=4, host_buffer_bytes=1 << 26), max_steps=10,
            callbacks=(a, b, Look()))
    finally:
        FaultLocalFileSystem.fault = Fault()
    assert seen and gaps == []
    assert sorted(os.listdir(tmp_path / "a")) == ["step=10.ckpt"]
    assert sorted(os.listdir(tmp_path / "b")) == ["step=10.ckpt"]


@pytest.mark.parametrize("slow", [3, 2])
def test_a_rotated_out_checkpoint_goes_as_soon_as_its_newer_one_is_durable_and_its_own_save_ended(tmp_path, slow):
    """ModelCheckpoint(save_top_k=1): step 3 removes step=2.ckpt while a save is still being
    written on slow storage: step=3.ckpt's (``slow=3``), or step=2.ckpt's own, which step=3.ckpt
    then outruns (``slow=2``). The removal must happen once step=3.ckpt is durable and step=2's
    own save has ended, not at a later batch end: a crash in between would leave step=2.ckpt
    behind for good, where stock deletes it right after its blocking save. The training thread
    waits at the start of the next batch, so no batch end comes meanwhile."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tmp_path / "d"
    d.mkdir()
    seen = {}

    def slow_storage(op, path):
        if f"/.step={slow}.ckpt." in path and op == "open":
            time.sleep(0.3)

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step != 3:  # the batch after step 3's update and batch end
                return
            seen["old at the request"] = (d / "step=2.ckpt").exists()
            deadline = time.monotonic() + 20
            while not gockpt.is_complete(str(d / "step=3.ckpt")) and time.monotonic() < deadline:
                time.sleep(0.005)
            while (d / "step=2.ckpt").exists() and time.monotonic() < deadline:
                time.sleep(0.005)
            seen["old gone"] = not (d / "step=2.ckpt").exists()

    FaultLocalFileSystem.fault = Fault(op_hook=slow_storage)
    try:
        fit(str(tmp_path / "run"), io=GoCkptIO(mode="async", max_inflight=4), max_steps=5,
            callbacks=(ModelCheckpoint(dirpath=local_url(d), filename="{step}", every_n_train_steps=1,
                                       save_top_k=1), Watch()))
    finally:
        FaultLocalFileSystem.fault = Fault()
    assert seen["old gone"] is True, seen
    if slow == 3:
        assert seen["old at the request"] is True, seen
    assert sorted(os.listdir(d)) == ["step=5.ckpt"]


def test_a_skipped_newer_save_never_lets_a_rotation_empty_its_folder(tmp_path):
    """``when_full="skip"``: folder B's save holds the only host slot on slow storage, so A's
    requests are skipped meanwhile, yet ModelCheckpoint removes A's previous checkpoint as if
    the newer one were written. The removal must wait for a durable newer checkpoint of A:
    from A's first complete checkpoint on, A always holds one, and it ends with one, its newest
    durable checkpoint (stock's would be step 12's; the skipped ones were never written)."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    b.mkdir()
    gaps, seen = [], []

    def slow(op, path):
        if "/b/" in path and op == "open":
            time.sleep(1.0)

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            complete = [n for n in os.listdir(a) if gockpt.is_complete(str(a / n))]
            if seen and not complete:
                gaps.append((trainer.global_step, sorted(os.listdir(a))))
            seen.extend(complete)

    FaultLocalFileSystem.fault = Fault(op_hook=slow)
    try:
        fit(str(tmp_path / "run"), io=GoCkptIO(mode="async", when_full="skip"), max_steps=12,
            callbacks=(ModelCheckpoint(dirpath=local_url(a), filename="{step}", every_n_train_steps=1, save_top_k=1),
                       ModelCheckpoint(dirpath=local_url(b), filename="{step}", every_n_train_steps=5, save_top_k=-1),
                       Watch()))
    finally:
        FaultLocalFileSystem.fault = Fault()
    assert seen and gaps == []
    left = os.listdir(a)
    assert len(left) == 1 and gockpt.is_complete(str(a / left[0])), left


def test_a_removal_awaiting_a_cancelled_save_is_released_by_a_later_durable_checkpoint_of_its_folder(tmp_path):
    """Two ModelCheckpoints in one folder: a top-1 one every step ("s-") and one keeping every
    epoch end ("ep-", step 10). Step 10 removes s-step=9 while s-step=10 is on slow storage: the
    removal waits for it. Step 11 removes s-step=10 once s-step=11, which replaces it, is
    durable, cancelling s-step=10's save. A durable checkpoint requested after it must then
    release s-step=9's removal too: the folder ends as stock's does, with no checkpoint left
    behind for good (the removal used to be dropped when the save it awaited was cancelled)."""
    import time

    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tmp_path / "d"
    d.mkdir()

    def wait_until(cond, what):
        deadline = time.monotonic() + 20
        while not cond():
            assert time.monotonic() < deadline, what
            time.sleep(0.01)

    def slow(op, path):  # storage slow for one checkpoint, and one held until step 11 is asked for
        if "/.s-step=10.ckpt." in path and op == "open":
            time.sleep(1.0)
        if "/.ep-step=10.ckpt." in path and op == "open":
            wait_until(lambda: (d / "s-step=11.ckpt").exists(), "the step-11 request")

    class RemoveWhenEpochEndIsDurable(GoCkptIO):
        def remove_checkpoint(self, path):
            if path.endswith("s-step=10.ckpt"):
                wait_until(lambda: gockpt.is_complete(str(d / "ep-step=10.ckpt")), "the epoch-end save")
            super().remove_checkpoint(path)

    def callbacks(url):
        return (ModelCheckpoint(dirpath=url, filename="s-{step}", every_n_train_steps=1, save_top_k=1),
                ModelCheckpoint(dirpath=url, filename="ep-{step}", every_n_epochs=1, save_top_k=-1))

    fit(str(tmp_path / "stock"), max_steps=14, callbacks=callbacks(str(tmp_path / "stock")))
    FaultLocalFileSystem.fault = Fault(op_hook=slow)
    try:
        fit(str(tmp_path / "run"), max_steps=14, callbacks=callbacks(local_url(d)),
            io=RemoveWhenEpochEndIsDurable(mode="async", max_inflight=8, host_buffer_bytes=1 << 26))
    finally:
        FaultLocalFileSystem.fault = Fault()
    stock = sorted(n for n in os.listdir(tmp_path / "stock") if n.endswith(".ckpt"))
    assert stock == ["ep-step=10.ckpt", "ep-step=14.ckpt", "s-step=14.ckpt"]
    assert sorted(os.listdir(d)) == stock


def test_a_top_k_checkpoint_is_removed_only_once_the_one_replacing_it_is_durable(tmp_path):
    """``ModelCheckpoint(monitor, save_top_k=2, save_last=True)``: each save step requests the new
    top-k checkpoint, removes the one leaving the top k, then saves ``last.ckpt``. Stock removes
    the old one after the new one is written, so the folder always holds two complete top-k
    checkpoints. The previous step's ``last.ckpt``, durable and requested after the removed
    one, must not release the removal while the new top-k checkpoint is still being written
    (slow storage for ``step=6.ckpt``): a crash then would find one."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tmp_path / "d"
    d.mkdir()
    gaps, most = [], []

    def slow(op, path):
        if "/.step=6.ckpt." in path and op == "open":
            time.sleep(0.5)

    def complete():
        return sorted(n for n in os.listdir(d) if n.startswith("step=") and gockpt.is_complete(str(d / n)))

    class Watch(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            if trainer.global_step == 5:  # step 4's saves durable before step 6's rotation
                deadline = time.monotonic() + 20
                while not all(gockpt.is_complete(str(d / n)) for n in os.listdir(d)):
                    assert time.monotonic() < deadline, os.listdir(d)
                    time.sleep(0.005)
            now = complete()
            most.append(len(now))
            if max(most) >= 2 and len(now) < 2:
                gaps.append((trainer.global_step, sorted(os.listdir(d))))

    def top_k(url):
        return ModelCheckpoint(dirpath=url, filename="{step}", every_n_train_steps=2, save_top_k=2,
                               save_last=True, monitor="score", mode="max")

    FaultLocalFileSystem.fault = Fault(op_hook=slow)
    try:
        fit(str(tmp_path / "run"), io=GoCkptIO(mode="async", max_inflight=4), max_steps=10,
            callbacks=(top_k(local_url(d)), Watch()))
    finally:
        FaultLocalFileSystem.fault = Fault()
    # (Three for a moment: the new one durable, the old one's deletion not yet run.)
    assert max(most) >= 2 and gaps == [], gaps
    fit(str(tmp_path / "stock"), max_steps=10, callbacks=(top_k(str(tmp_path / "stock")),))
    stock = sorted(n for n in os.listdir(tmp_path / "stock") if n.endswith(".ckpt"))
    assert stock == ["last.ckpt", "step=10.ckpt", "step=8.ckpt"]
    assert sorted(os.listdir(d)) == stock


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_full_save_whose_hook_drops_the_optimizer_state_stays_a_full_save_at_a_later_captured_step(tmp_path, mode):
    """A module's ``on_save_checkpoint`` drops ``optimizer_states`` (smaller files). The save is
    still a full one: held at a later step (K = 3), its re-dump must keep the callbacks' and
    schedulers' state and run the callbacks' hooks (``EMAWeightAveraging`` swaps the averaged
    weights into ``state_dict``), equal bit for bit to stock's file of the step it holds."""
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint

    class Smaller(TinyNet):
        def on_save_checkpoint(self, checkpoint):
            super().on_save_checkpoint(checkpoint)
            checkpoint.pop("optimizer_states", None)

    def run(root, every, io):
        import lightning.pytorch as pl

        pl.seed_everything(0, verbose=False)
        trainer = pl.Trainer(default_root_dir=root, max_steps=10, accelerator="cpu", logger=False,
                             limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                             num_sanity_val_steps=0, plugins=[io] if io else None,
                             callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=every,
                                                        save_top_k=-1), EMAWeightAveraging(decay=0.5)])
        trainer.fit(Smaller())

    run(str(tmp_path / "stock"), 1, None)
    run(str(tmp_path / "run"), 3, GoCkptIO(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    names = sorted(os.listdir(tmp_path / "run"))
    assert names == ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt"]
    held = []
    for name in names:
        got = GoCkptIO().load_checkpoint(str(tmp_path / "run" / name))
        held.append(got["global_step"])
        want = torch.load(tmp_path / "stock" / f"step={got['global_step']}.ckpt", weights_only=False)
        assert set(got) == set(want) and "optimizer_states" not in got
        for key in ("state_dict", "lr_schedulers", "rng_state"):
            assert_bitwise_equal(got[key], want[key], key)
        ema = [k for k in want["callbacks"] if "EMAWeightAveraging" in k or "WeightAveraging" in k]
        assert ema
        for k in ema:
            assert_bitwise_equal(got["callbacks"][k], want["callbacks"][k], k)
    assert held != [3, 6, 9]  # held at later steps: the re-dump is what is tested


@pytest.mark.parametrize(("mode", "optim"), [("sync", "momentum"), ("gockpt", "momentum"),
                                             ("gockpt", "sgd"), ("gockpt_o", "adagrad")])
def test_state_the_shards_cannot_hold_is_saved_as_stock_saves_it(tmp_path, mode, optim):
    """A sparse embedding under SGD with momentum (a sparse momentum buffer), a complex
    parameter, complex, uint16 and sparse buffers: the shards hold none of them, and the run
    used to fail at its first checkpoint. They are stored as ``torch.save`` stores them, the
    checkpoint equal to stock's file of the step it holds, and a resume from it continues as
    a resume from stock's. Under plain SGD or Adagrad the embedding's sparse gradients meet
    dense (or no) state: multi-step saves failed on their copy (and a later one waited
    forever for a gradient buffer); the embedding is now taken at the captured step."""
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from torch import nn

    class Odd(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(16, 4, sparse=True)
            self.lin = nn.Linear(4, 2)
            self.rot = nn.Parameter(torch.randn(4, dtype=torch.complex64))
            self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))
            self.register_buffer("counts", torch.zeros(3, dtype=torch.uint16))
            self.register_buffer("mask", torch.eye(3).to_sparse())

        def training_step(self, batch, batch_idx):
            h = self.emb(batch[:, 0].long() % 16)
            h = h * (self.rot * self.freqs).real
            self.counts.copy_((self.counts.int() + 1).to(torch.uint16))
            return (self.lin(h) - batch[:, 1:3]).pow(2).mean()

        def configure_optimizers(self):
            if optim == "adagrad":
                return torch.optim.Adagrad(self.parameters(), lr=0.05)
            return torch.optim.SGD(self.parameters(), lr=0.05, momentum=0.9 if optim == "momentum" else 0.0)

        def train_dataloader(self):
            g = torch.Generator().manual_seed(0)
            data = torch.cat([torch.randint(0, 16, (64, 1), generator=g).float(), torch.randn(64, 2, generator=g)], 1)
            return torch.utils.data.DataLoader(data, batch_size=4)

    def run(root, every, io, max_steps=8, ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        model = Odd()
        trainer = pl.Trainer(default_root_dir=root, max_steps=max_steps, accelerator="cpu", logger=False,
                             enable_progress_bar=False, enable_model_summary=False, plugins=[io] if io else None,
                             callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=every,
                                                        save_top_k=-1)])
        trainer.fit(model, ckpt_path=ckpt_path)
        return model

    run(str(tmp_path / "stock"), 1, None)
    kw = {"min_overlap_steps": 3, "max_overlap_steps": 3} if mode != "sync" else {}
    run(str(tmp_path / "run"), 3, GoCkptIO(mode=mode, **kw))
    names = sorted(os.listdir(tmp_path / "run"))
    assert names == ["step=3.ckpt", "step=6.ckpt"]
    for name in names:
        got = GoCkptIO().load_checkpoint(str(tmp_path / "run" / name))
        want = torch.load(tmp_path / "stock" / f"step={got['global_step']}.ckpt", weights_only=False)
        if mode != "sync":
            assert got["global_step"] > int(name[5])  # held a later step: a multi-step save
        if optim == "momentum":
            assert got["optimizer_states"][0]["state"][1]["momentum_buffer"].layout == torch.sparse_coo
        for key in ("state_dict", "optimizer_states"):
            assert_bitwise_equal(got[key], want[key], key)
    # A resume from it continues as one from stock's file of the step it holds.
    held = GoCkptIO().load_checkpoint(str(tmp_path / "run" / names[-1]))["global_step"]
    a = run(str(tmp_path / "r1"), 100, GoCkptIO(), max_steps=12, ckpt_path=str(tmp_path / "run" / names[-1]))
    b = run(str(tmp_path / "r2"), 100, None, max_steps=12, ckpt_path=str(tmp_path / "stock" / f"step={held}.ckpt"))
    assert_bitwise_equal(dict(a.state_dict()), dict(b.state_dict()), "resumed")


@pytest.mark.parametrize("mode", ["sync", "gockpt"])
def test_parameters_and_requires_grad_in_the_dict_load_as_stock_loads_them(tmp_path, mode):
    """A hook puts a live parameter (tracked: a reference to its shard entry) and a leaf tensor
    requiring gradients into the checkpoint dict: they load as ``torch.load`` gives them from
    stock's file, an ``nn.Parameter`` and a tensor with ``requires_grad`` (they came back as
    plain tensors)."""
    from _lightning_train import TinyNet

    class Keep(TinyNet):
        def on_save_checkpoint(self, checkpoint):
            super().on_save_checkpoint(checkpoint)
            checkpoint["live"] = self.net[0].weight
            checkpoint["leaf"] = torch.ones(2, requires_grad=True)

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint

    for root, io in ((tmp_path / "stock", None), (tmp_path / "run", GoCkptIO(mode=mode))):
        pl.seed_everything(0, verbose=False)
        pl.Trainer(default_root_dir=root, max_steps=4, accelerator="cpu", logger=False, limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[io] if io else None,
                   callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", every_n_train_steps=4)]).fit(Keep())
    got = GoCkptIO().load_checkpoint(str(tmp_path / "run" / "step=4.ckpt"))
    want = torch.load(tmp_path / "stock" / "step=4.ckpt", weights_only=False)
    for key in ("live", "leaf"):
        assert type(got[key]) is type(want[key]) and got[key].requires_grad == want[key].requires_grad, key
        assert torch.equal(got[key], want[key]), key
    assert type(want["live"]) is torch.nn.Parameter and want["leaf"].requires_grad


@pytest.mark.parametrize("opt", ["sgd", "adamw"])
def test_a_resumed_run_records_lightnings_steps_whatever_state_its_optimizer_keeps(tmp_path, opt):
    """A run resumed into the same folder: its manifests record Lightning's global steps also
    when the optimizer keeps no state (plain SGD; they used to count from 0 again), so an
    incomplete ``last.ckpt`` resolves to the newest checkpoint, not to an older one."""
    import json
    import warnings

    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Net(TinyNet):
        def configure_optimizers(self):
            if opt == "sgd":
                return torch.optim.SGD(self.parameters(), lr=0.05)
            return super().configure_optimizers()

    d = tmp_path / "ck"

    def run(max_steps, ckpt_path=None):
        pl.seed_everything(0, verbose=False)
        pl.Trainer(default_root_dir=tmp_path, max_steps=max_steps, accelerator="cpu", logger=False,
                   limit_val_batches=0, enable_progress_bar=False, enable_model_summary=False,
                   plugins=[GoCkptIO(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3)],
                   callbacks=[ModelCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, every_n_train_steps=4,
                                              save_last=True)]).fit(Net(), ckpt_path=ckpt_path)

    run(8)
    run(16, ckpt_path=str(d / "last.ckpt"))
    for name in sorted(os.listdir(d)):
        meta = json.loads((d / name / "manifest.json").read_text())["meta"]
        held = GoCkptIO().load_checkpoint(str(d / name))["global_step"]
        assert meta["captured_step"] == held, (name, meta["captured_step"], held)
    # A kill while last.ckpt was being replaced leaves its request-time placeholder.
    import shutil

    shutil.rmtree(d / "last.ckpt")
    (d / "last.ckpt").mkdir()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert GoCkptIO().load_checkpoint(str(d / "last.ckpt"))["global_step"] == 16


@pytest.mark.parametrize("swap", [4, 5, 6])
def test_optimizers_replaced_mid_run_are_followed(tmp_path, swap):
    """``trainer.optimizers = [SGD(...)]`` at the batch start of step ``swap``: the engine is
    rebuilt over the new optimizer, so its manifests go on recording Lightning's steps (they
    froze there, and an incomplete ``last.ckpt`` resolved to an older checkpoint) and each
    checkpoint equals stock's file of the step it holds. The save requested at step 4 (K = 3)
    is captured at step 6: with the swap before that it cannot hold one step any more (the new
    optimizer's update went past it) and is not written, never torn; with the swap at 6 its
    copies finish before the new optimizer's first update."""
    import json

    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Swap(TinyNet):
        def on_train_batch_start(self, batch, batch_idx):
            if self.trainer.global_step == swap and not isinstance(self.trainer.optimizers[0], torch.optim.SGD):
                self.trainer.optimizers = [torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)]

    def run(root, every, io):
        pl.seed_everything(0, verbose=False)
        pl.Trainer(default_root_dir=root, max_steps=16, accelerator="cpu", logger=False, limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[io] if io else None,
                   callbacks=[ModelCheckpoint(dirpath=root, filename="{step}", save_top_k=-1,
                                              every_n_train_steps=every)]).fit(Swap())

    run(tmp_path / "stock", 1, None)
    run(tmp_path / "run", 4, GoCkptIO(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    names = sorted(os.listdir(tmp_path / "run"))
    written = ["step=12.ckpt", "step=16.ckpt", "step=8.ckpt"]
    assert names == (written if swap < 6 else sorted(written + ["step=4.ckpt"]))
    for name in names:
        meta = json.loads((tmp_path / "run" / name / "manifest.json").read_text())["meta"]
        got = GoCkptIO().load_checkpoint(str(tmp_path / "run" / name))
        assert meta["captured_step"] == got["global_step"], name
        want = torch.load(tmp_path / "stock" / f"step={got['global_step']}.ckpt", weights_only=False)
        for key in ("state_dict", "optimizer_states", "lr_schedulers"):
            assert_bitwise_equal(got[key], want[key], f"{name}.{key}")


def test_checkpoints_taken_whole_at_the_request_record_lightning_steps(tmp_path):
    """Two optimizers over the same parameters: the state is taken whole at each request (no
    engine tracks the live tensors). Its manifests record Lightning's step, not 0, so a
    ``last.ckpt`` cut short by a kill resolves to the newest checkpoint beside it."""
    import json
    import shutil
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import ModelCheckpoint
    from test_lightning_fidelity import Net

    d = tmp_path / "ck"
    pl.seed_everything(0, verbose=False)
    pl.Trainer(default_root_dir=tmp_path, max_steps=12, accelerator="cpu", logger=False,
               enable_progress_bar=False, enable_model_summary=False, plugins=[GoCkptIO(mode="gockpt_o")],
               callbacks=[ModelCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, every_n_train_steps=4,
                                          save_last=True)]).fit(Net("shared"))
    names = sorted(os.listdir(d))
    assert names == ["last.ckpt", "step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    for name in names:
        meta = json.loads((d / name / "manifest.json").read_text())["meta"]
        assert meta["captured_step"] == GoCkptIO().load_checkpoint(str(d / name))["global_step"], name
    shutil.rmtree(d / "last.ckpt")
    (d / "last.ckpt").mkdir()  # the request-time placeholder a kill leaves
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert GoCkptIO().load_checkpoint(str(d / "last.ckpt"))["global_step"] == 12


def _linear_module(samples: int, table: list[float] | None = None):
    """A linear regression LightningModule over ``samples`` random rows (batches of 8); with
    ``table`` it logs ``m = table[global_step]`` for a monitored ModelCheckpoint."""
    import lightning.pytorch as pl
    from torch import nn

    class Linear(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(8, 4)

        def training_step(self, batch, batch_idx):
            if table is not None:
                self.log("m", float(table[self.global_step]), on_step=True, on_epoch=False)
            return self.lin(batch).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.randn(samples, 8, generator=torch.Generator().manual_seed(0)),
                                               batch_size=8)

    return Linear()


def test_a_skipped_replacement_keeps_the_top_k_checkpoint_it_was_to_replace(tmp_path):
    """``when_full="skip"``, ``ModelCheckpoint(monitor, save_top_k=2, save_last=True)``, the
    metric 5, 3, 4, 9, 9, ...: step 3's checkpoint displaces step 1's but is skipped (step 2's
    still holds the one host slot on slow storage). ModelCheckpoint counts it as written, so
    step 1's stays until a checkpoint of that path, or what replaces it, is durable; a later
    ``last.ckpt`` does not stand in for it. The folder keeps two complete top-k checkpoints,
    as stock's does (it kept one from step 5 on). Ordered by events, not by storage speed:
    step 2's write is held until step 3's request has been made."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    table = [5, 3, 4, 9, 9, 9, 9, 9, 9]

    d = tmp_path / "d"
    d.mkdir()
    counts = []
    step_3_asked = threading.Event()

    def settle():
        deadline = time.monotonic() + 30
        while not all(not n.startswith(".") and gockpt.is_complete(str(d / n)) for n in os.listdir(d)):
            assert time.monotonic() < deadline, os.listdir(d)
            time.sleep(0.01)

    class Pace(pl.Callback):  # before ModelCheckpoint's batch end (Lightning puts it last)
        def on_train_batch_end(self, trainer, *args):
            if trainer.global_step in (2, 4, 5):  # the saves before are done first
                settle()

        def on_train_batch_start(self, trainer, *args):
            counts.append(sum(1 for n in os.listdir(d) if n.startswith("step=") and gockpt.is_complete(str(d / n))))
            if trainer.global_step == 3:  # step 3's saves were requested (and skipped)
                step_3_asked.set()

    def slow(op, path):
        if op == "open" and "/.step=2.ckpt." in path:
            step_3_asked.wait(30)  # the one host slot stays taken through step 3's request

    FaultLocalFileSystem.fault = Fault(op_hook=slow)
    try:
        pl.seed_everything(0, verbose=False)
        pl.Trainer(default_root_dir=tmp_path, max_steps=8, accelerator="cpu", logger=False, limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False,
                   plugins=[GoCkptIO(mode="async", max_inflight=1, when_full="skip")],
                   callbacks=[Pace(), ModelCheckpoint(dirpath=local_url(d), filename="{step}", monitor="m", mode="min",
                                                      save_top_k=2, every_n_train_steps=1, save_last=True)]
                   ).fit(_linear_module(64, table))
    finally:
        FaultLocalFileSystem.fault = Fault()
    assert not gockpt.is_complete(str(d / "step=3.ckpt"))  # the skipped one
    # counts[k]: at the batch start after step k's saves were requested; from step 5 on every
    # save before is done (settle), the skipped one included.
    assert counts[5:] == [2] * len(counts[5:]), counts
    left = sorted(n for n in os.listdir(d) if gockpt.is_complete(str(d / n)))
    assert left == ["last.ckpt", "step=1.ckpt", "step=2.ckpt"], left


def test_a_top_1_folder_saved_every_step_on_slow_storage_holds_one_or_two_checkpoints(tmp_path):
    """``ModelCheckpoint(save_top_k=1)`` every step, GoCkptIO's defaults, slow storage: each
    save is still in flight when the next step removes it. The removal of the one before must
    still go once either of them is durable: the folder holds one or two complete checkpoints
    while the run goes on (an earlier rule kept re-pointing each removal at the newest
    request, and every checkpoint of the run stayed until its end)."""
    import time

    import lightning.pytorch as pl
    from faultfs import Fault, FaultLocalFileSystem, local_url
    from lightning.pytorch.callbacks import ModelCheckpoint

    d = tmp_path / "d"
    d.mkdir()
    counts = []

    class Count(pl.Callback):
        def on_train_batch_start(self, trainer, *args):
            counts.append(sum(1 for n in os.listdir(d) if n.startswith("step=") and gockpt.is_complete(str(d / n))))

    FaultLocalFileSystem.fault = Fault(op_hook=lambda op, path: time.sleep(0.03) if op == "open" else None)
    try:
        pl.Trainer(default_root_dir=tmp_path, max_steps=30, accelerator="cpu", logger=False, limit_val_batches=0,
                   enable_progress_bar=False, enable_model_summary=False, plugins=[GoCkptIO()],
                   callbacks=[Count(), ModelCheckpoint(dirpath=local_url(d), filename="{step}", save_top_k=1,
                                                       every_n_train_steps=1)]).fit(_linear_module(400))
    finally:
        FaultLocalFileSystem.fault = Fault()
    assert max(counts) <= 2 and counts[-1] >= 1, counts
    assert sorted(os.listdir(d)) == ["step=30.ckpt"]


_SLURM_ENV = {"SLURM_NTASKS": "1", "SLURM_JOB_ID": "123", "SLURM_JOB_NAME": "train", "SLURM_NODELIST": "localhost",
              "SLURM_PROCID": "0", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_NTASKS_PER_NODE": "1"}


def test_a_slurm_requeue_save_is_durable_at_once_and_the_requeued_job_resumes_from_it(tmp_path, monkeypatch):
    """Lightning's SLURM handler saves ``hpc_ckpt_<n>.ckpt`` on the requeue signal, and the job
    is then killed; the requeued job resumes from the highest ``<n>`` in ``default_root_dir``.
    The save was requested like any other (in flight for K = 3 steps, lost to the kill) and a
    kill inside a later one left a placeholder and a scratch folder whose digits Lightning read
    as the newest version. Now the hpc save is durable when the handler returns (and moves no
    ``latest`` pointer), what a killed hpc save leaves is cleared when the next Trainer is made,
    and the resumed run ends as stock's."""
    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.plugins.environments import SLURMEnvironment

    for k, v in _SLURM_ENV.items():
        monkeypatch.setenv(k, v)
    from lightning.pytorch.trainer.connectors import signal_connector

    monkeypatch.setattr(signal_connector, "call", lambda *a, **k: 0)  # its `scontrol requeue`

    def run(use_gockpt: bool) -> dict:
        root = tmp_path / ("gockpt" if use_gockpt else "stock")
        seen: dict[str, bool] = {}

        class Requeue(Callback):
            def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
                if trainer.global_step == 3:
                    os.kill(os.getpid(), signal.SIGUSR1)  # the handler runs before the next line
                    seen["durable"] = is_complete(str(root / "hpc_ckpt_1.ckpt")) if use_gockpt \
                        else (root / "hpc_ckpt_1.ckpt").is_file()
                if trainer.global_step == 5:
                    raise Crash("killed after the requeue")

        def trainer(callbacks):
            pl.seed_everything(0, verbose=False)
            env = SLURMEnvironment(auto_requeue=True, requeue_signal=signal.SIGUSR1)
            return pl.Trainer(default_root_dir=str(root), max_steps=12, accelerator="cpu", logger=False,
                              enable_checkpointing=False, enable_progress_bar=False,
                              enable_model_summary=False, callbacks=callbacks,
                              # update_latest: an hpc save leaves the pointer alone (its lock
                              # may be held by the thread the signal interrupted)
                              plugins=[env] + ([gockpt_io("gockpt", update_latest=True)] if use_gockpt else []))

        with pytest.raises(Crash):
            trainer([Requeue()]).fit(TinyNet())
        assert seen["durable"]
        if use_gockpt:  # what a kill inside a second hpc save leaves
            dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"],
                                  capture_output=True, text=True).stdout.strip()
            (root / f".hpc_ckpt_2.ckpt.gockpt-tmp-{dead}-0abc").mkdir()
            (root / "hpc_ckpt_2.ckpt").mkdir()
        requeued = trainer([])
        assert sorted(os.listdir(root)) == ["hpc_ckpt_1.ckpt"]
        model = TinyNet()
        requeued.fit(model)
        assert requeued.ckpt_path == str(root / "hpc_ckpt_1.ckpt") and requeued.global_step == 12
        return dict(model.state_dict())

    assert_bitwise_equal(run(True), run(False), "resumed")


def test_another_gockptio_loads_a_checkpoint_the_running_fit_has_in_flight(tmp_path):
    """An evaluation inside a fit (a callback running ``Trainer(plugins=[GoCkptIO()]).validate(
    ckpt_path=...)``) loads through its own GoCkptIO: the fit's save of that path, still in its
    copy windows, is finished first, as when the plugin is shared. That load raised
    FileNotFoundError (the placeholder), and ``last.ckpt`` gave the checkpoint before."""
    from lightning.pytorch.callbacks import Callback

    got: dict[str, dict] = {}

    class Evaluate(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == 9:  # step=8.ckpt requested at 8, in its windows (K = 3)
                for name in ("step=8.ckpt", "last.ckpt"):
                    got[name] = GoCkptIO().load_checkpoint(str(tmp_path / name))

    trainer, _ = fit(str(tmp_path), io=gockpt_io("gockpt"), ckpt_every=4, save_last=True,
                     max_steps=12, callbacks=(Evaluate(),))
    # Finished at the load: its windows end at this step, so it holds step 9.
    assert got["step=8.ckpt"]["global_step"] == got["last.ckpt"]["global_step"] == 9
    # What it read is what the checkpoint holds now, the fit done.
    assert_bitwise_equal(got["step=8.ckpt"]["state_dict"],
                         GoCkptIO().load_checkpoint(str(tmp_path / "step=8.ckpt"))["state_dict"], "loaded")


@pytest.mark.parametrize("editor", [False, True])
def test_an_epoch_end_save_overlaps_the_next_step_unless_code_may_edit_weights_at_the_epoch_start(
        tmp_path, editor):
    """Every epoch start finished the copies in flight (in case a callback swaps weights in
    there through ``.data``, as SWA does): the copy of a save requested at the epoch's end,
    stock's ModelCheckpoint default, never overlapped the next step. Now only where another
    callback or the module defines ``on_train_epoch_start``; there the checkpoint still holds
    the weights before the swap, as stock's."""
    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint, TQDMProgressBar

    class Swap(Callback):  # writes the weights through .data, as weight averaging does
        def on_train_epoch_start(self, trainer, pl_module):
            with torch.no_grad():
                for p in pl_module.parameters():
                    p.data.mul_(0.5)

    got: list = []

    class Grab(Callback):
        def on_train_end(self, trainer, pl_module):  # after GoCkpt's, which waits for them all
            cb = getattr(trainer.strategy.checkpoint_io, "_callback", None)
            if cb is not None:
                got.extend(cb.engine.metrics)

    def run(root, io):
        pl.seed_everything(0, verbose=False)
        cbs = [Grab(), TQDMProgressBar(), ModelCheckpoint(dirpath=str(root), filename="{step}", save_top_k=-1)]
        trainer = pl.Trainer(default_root_dir=str(root), max_epochs=3, limit_train_batches=4, accelerator="cpu",
                             logger=False, enable_progress_bar=True, enable_model_summary=False,
                             callbacks=cbs + ([Swap()] if editor else []), plugins=[io] if io else None)
        trainer.fit(TinyNet())

    run(tmp_path / "ours", GoCkptIO(mode="lazy"))
    saves = sorted(got, key=lambda m: m.requested_step)
    assert len(saves) == 3
    # (Once a swap was seen, later saves are copied at their request: mode async, no flush.)
    for m in saves[:1] if editor else saves[:2]:  # the last one is finished when training ends
        assert ("flush" in m.stall_by_phase_s) == editor, m.stall_by_phase_s
    if editor:
        run(tmp_path / "stock", None)
        names = sorted(os.listdir(tmp_path / "stock"))
        assert names == sorted(os.listdir(tmp_path / "ours")) and len(names) == 3
        for name in names:
            ours = GoCkptIO().load_checkpoint(str(tmp_path / "ours" / name))
            stock = torch.load(tmp_path / "stock" / name, weights_only=False)
            assert_bitwise_equal(ours["state_dict"], stock["state_dict"], name)


def test_a_callback_that_is_a_mock_counts_as_code_at_the_epoch_start(tmp_path):
    # Lightning's own tests pass Mock(spec=Callback) callbacks: whether one defines
    # on_train_epoch_start is not found on its type, and asking raised AttributeError at the
    # first epoch start. It counts as one that may edit weights there.
    from unittest.mock import Mock

    import lightning.pytorch as pl
    from _lightning_train import TinyNet
    from lightning.pytorch.callbacks import Callback

    cb = Mock(spec=Callback, model=Callback())
    pl.Trainer(default_root_dir=str(tmp_path), max_steps=2, accelerator="cpu", logger=False,
               enable_progress_bar=False, enable_model_summary=False, enable_checkpointing=False, callbacks=[cb],
               plugins=[GoCkptIO(mode="lazy")]).fit(TinyNet())
    assert cb.on_train_epoch_start.called
