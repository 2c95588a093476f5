"""accelerate_gockpt: non-blocking save_state in Accelerate's layout, native load_state resumes.

The central check: train with GoCkpt checkpoints, resume each checkpoint with *plain*
``accelerator.load_state`` in a fresh model, and find the state equal, bit for bit, to the live
run at the checkpoint's captured step, then train on and end equal to an uninterrupted run.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import sys
import threading
import uuid
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import accelerate_gockpt
import gockpt
from accelerate_gockpt import GoCkptPlugin, attach
from gockpt.audit import describe_checkpoint, verify_checkpoint

_HERE = Path(__file__).resolve().parent
_REPO = _HERE.parents[1]


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


child = _load("gockpt_accelerate_child", _HERE / "test_accelerate_child.py")

MODES = ["sync", "async", "lazy", "gockpt", "gockpt_o", "auto"]
TOTAL = 16
SAVE_AT = (2, 4, 8)  # accumulation boundaries: gradients are never part of a checkpoint
def listing(path):
    """The folder's files, GoCkpt's own (``manifest.json``, written last, and the engine's
    small ``state-*.pt``) checked and left out."""
    names = set(os.listdir(path))
    ours = {n for n in names if n == "manifest.json" or (n.startswith("state-") and n.endswith(".pt"))}
    assert len(ours) == 2, sorted(names)
    return names - ours


ACCELERATE_FILES = {"model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl",
                    "custom_checkpoint_0.pkl", "gockpt.json"}


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    # Tiny ops on 2 shared cores: one intra-op thread is ~10x faster and keeps runs short.
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """``reference(accumulation, scaler, inf_at, accumulate)`` -> {batches: live snapshot}."""
    cache: dict[tuple, dict[int, dict]] = {}

    def get(accumulation: int = 1, scaler: bool = False, inf_at: int | None = None,
            accumulate: bool = True) -> dict[int, dict]:
        key = (accumulation, scaler, inf_at, accumulate)
        if key not in cache:
            run = child.build(str(tmp_path_factory.mktemp("ref")), accumulation=accumulation, scaler=scaler)
            live: dict[int, dict] = {}
            child.train(run, TOTAL, inf_at=inf_at, accumulate=accumulate, on_batch_end=lambda r: live.__setitem__(
                r.progress.batches, child.snapshot(r)))
            cache[key] = live
        return cache[key]

    return get


def _train_with_gockpt(project_dir, plugin, *, accumulation=1, scaler=False, inf_at=None,
                       save_at=SAVE_AT, total_limit=None):
    run = child.build(str(project_dir), accumulation=accumulation, scaler=scaler, total_limit=total_limit)
    ckpt = attach(run.acc, plugin)
    calls = []

    def on_batch_end(r):
        if r.progress.batches in save_at:
            calls.append(r.acc.save_state())

    child.train(run, TOTAL, inf_at=inf_at, on_batch_end=on_batch_end)
    metrics = ckpt.wait()
    final = child.snapshot(run)
    ckpt.close()
    return run, calls, metrics, final


def _assert_resumes_exactly(path, live, *, accumulation=1, scaler=False, inf_at=None, use_gockpt=False,
                            accumulate=True):
    """Plain (or GoCkpt-attached) load_state in a fresh run equals the live run, then and at the end."""
    fresh = child.build(str(Path(path).parent.parent / f"resume-{uuid.uuid4().hex[:6]}"), seed=3,
                        accumulation=accumulation, scaler=scaler)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync")) if use_gockpt else None
    fresh.acc.load_state(str(path))
    c = fresh.progress.batches
    got, want = child.snapshot(fresh), live[c]
    diffs = []
    for key in ("model", "optim", "sched", "rng", "step", "scaler"):
        diffs += child.differences(got[key], want[key], f"{Path(path).name}@{c}:{key}")
    child.train(fresh, TOTAL, inf_at=inf_at, accumulate=accumulate)
    diffs += child.differences(child.snapshot(fresh)["model"], live[TOTAL]["model"], "after resume")
    if ckpt is not None:
        ckpt.close()
    assert diffs == []
    return c


@pytest.mark.parametrize("accumulation", [1, 2])
@pytest.mark.parametrize("mode", MODES)
def test_resume_from_each_checkpoint_is_bit_identical(tmp_path, reference, mode, accumulation):
    # Clipping and a per-step scheduler run on every update; accumulation=2 skips every other
    # optimizer step inside Accelerate's wrapper.
    live = reference(accumulation)
    plugin = GoCkptPlugin(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                          host_buffer_bytes=1 << 26)  # room for overlapping saves
    run, calls, metrics, final = _train_with_gockpt(tmp_path / "run", plugin, accumulation=accumulation)
    assert child.differences(final["model"], live[TOTAL]["model"]) == []  # training unperturbed
    assert [p.name for p in calls] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    assert len(metrics) == 3
    by_path = {m.path: m for m in metrics}  # published in any order (auto: K per save)
    for path in calls:
        m = by_path[str(path)]
        assert listing(path) == ACCELERATE_FILES
        sidecar = json.loads((path / "gockpt.json").read_text())
        assert sidecar["captured_step"] == m.captured_step and sidecar["mode"] == m.mode
        if mode in ("gockpt", "gockpt_o"):
            assert m.num_overlap_steps == 3 and m.captured_step == m.requested_step + 2
        elif mode != "auto":
            assert m.captured_step == m.requested_step
        batches = _assert_resumes_exactly(path, live, accumulation=accumulation)
        assert batches >= SAVE_AT[calls.index(path)]
    # Nothing but the checkpoints: no staging folder in the project, no hidden leftovers.
    assert os.listdir(tmp_path / "run") == ["checkpoints"]
    assert sorted(os.listdir(tmp_path / "run" / "checkpoints")) == [p.name for p in calls]


def test_loop_without_accumulate_resumes_exactly(tmp_path, reference):
    # Without accelerator.accumulate() the model's forward pre-hook is the step boundary.
    live = reference(1, accumulate=False)
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                        host_buffer_bytes=1 << 26))  # room for overlapping saves
    child.train(run, TOTAL, accumulate=False,
                on_batch_end=lambda r: r.acc.save_state() if r.progress.batches in SAVE_AT else None)
    metrics = ckpt.wait()
    ckpt.close()
    assert sorted(m.captured_step for m in metrics) == [4, 6, 10]  # published in any order
    for name in ("checkpoint_0", "checkpoint_2"):
        _assert_resumes_exactly(tmp_path / "run" / "checkpoints" / name, live, accumulate=False)


@pytest.mark.parametrize("same_keys", [False, True], ids=["distinct-keys", "same-keys"])
def test_two_models_and_optimizers_are_saved_as_accelerate_does(tmp_path, same_keys):
    """Also with two models whose state_dict keys coincide (``0.weight`` in both files): the
    folder verifies, and GoCkpt's own load_state reads it as stock's does."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    def make(seed):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
            project_dir=str(tmp_path), automatic_checkpoint_naming=True))
        torch.manual_seed(seed)
        gen = (torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 4))
               if same_keys else torch.nn.Linear(4, 4))
        disc = torch.nn.Sequential(torch.nn.Linear(4, 1))
        og, od = (torch.optim.Adam(m.parameters(), lr=1e-2) for m in (gen, disc))
        return (acc, *acc.prepare(gen, disc, og, od))

    def step(gen, disc, og, od, i):
        x = torch.randn(8, 4, generator=torch.Generator().manual_seed(i))
        disc(gen(x).detach()).mean().backward()
        od.step()
        od.zero_grad()
        (-disc(gen(x)).mean()).backward()
        og.step()
        og.zero_grad()

    acc, *objs = make(0)
    ckpt = attach(acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    for i in range(3):
        step(*objs, i)
    path = acc.save_state()
    want = [{k: v.clone() for k, v in m.state_dict().items()} for m in objs[:2]]
    want_opt = [o.state_dict()["state"][0]["exp_avg"].clone() for o in objs[2:]]
    for i in range(3, 5):  # a window of K=2 would otherwise end between the two steps
        step(*objs, i)
    ckpt.close()
    assert {"model.safetensors", "model_1.safetensors", "optimizer.bin", "optimizer_1.bin"} <= set(os.listdir(path))
    assert verify_checkpoint(str(path)) == []
    # Every tensor of both files is in the manifest's index, so each file's header is checked;
    # the index names a header key only where the keys coincide (format version 2 then).
    info = describe_checkpoint(str(path))
    assert len(info["tensors"]) == sum(len(w) for w in want)
    assert info["format_version"] == (2 if same_keys else 1)
    for attached in (False, True):
        acc2, *objs2 = make(1)
        ckpt2 = attach(acc2, GoCkptPlugin(mode="sync")) if attached else None
        acc2.load_state(str(path))
        for got, w in zip(objs2[:2], want, strict=True):
            assert child.differences(dict(got.state_dict()), w) == []
        for got, w in zip(objs2[2:], want_opt, strict=True):
            assert torch.equal(got.state_dict()["state"][0]["exp_avg"], w)
        if ckpt2 is not None:
            ckpt2.close()


def test_gradscaler_overflow_step_is_not_replayed(tmp_path, reference):
    # The inf in the 5th batch makes the GradScaler skip that update inside the copy window of
    # the checkpoint requested after batch 4: K=3 then spans batches 5-7 (updates 5 and 6).
    live = reference(1, scaler=True, inf_at=4)
    plugin = GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                          host_buffer_bytes=1 << 26)  # room for overlapping saves
    _, calls, metrics, final = _train_with_gockpt(tmp_path / "run", plugin, scaler=True, inf_at=4)
    assert child.differences(final["model"], live[TOTAL]["model"]) == []
    m = metrics[1]
    assert m.captured_step == m.requested_step + 2
    assert "scaler.pt" in os.listdir(calls[1])
    assert (m.requested_step, m.captured_step) == (4, 6)
    assert _assert_resumes_exactly(calls[1], live, scaler=True, inf_at=4) == 7
    assert _assert_resumes_exactly(calls[0], live, scaler=True, inf_at=4) == 4


def test_exact_step_holds_the_step_of_the_request(tmp_path, reference):
    live = reference(1)
    plugin = GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3, exact_step=True)
    _, calls, metrics, _ = _train_with_gockpt(tmp_path / "run", plugin)
    assert sorted((m.requested_step, m.captured_step) for m in metrics) == [(2, 2), (4, 4), (8, 8)]
    assert _assert_resumes_exactly(calls[1], live) == 4


def test_save_state_returns_while_the_engine_persists(tmp_path, monkeypatch):
    import gockpt._pipeline as pipeline_mod

    gate, entered = threading.Event(), threading.Event()
    real = pipeline_mod.persist

    def held(req):
        entered.set()
        assert gate.wait(60)
        return real(req)

    monkeypatch.setattr(pipeline_mod, "persist", held)
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="async"))
    child.train(run, 2)
    path = run.acc.save_state()
    assert entered.wait(60)
    child.train(run, 6)  # the training thread is not held by the persist
    assert run.progress.batches == 6 and not path.exists() and not ckpt.saves[0].done()
    gate.set()
    ckpt.saves[0].result(60)
    assert listing(path) == ACCELERATE_FILES
    ckpt.close()


def test_total_limit_deletes_only_after_the_new_checkpoint_is_published(tmp_path):
    run = child.build(str(tmp_path / "run"), total_limit=2)
    # Multi-step: checkpoint_2 stays in flight over the next updates.
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
    root = tmp_path / "run" / "checkpoints"
    for batches in (1, 2):
        child.train(run, batches)
        run.acc.save_state()
        ckpt.wait()
    child.train(run, 3)
    run.acc.save_state()
    assert not ckpt.saves[-1].done()
    # Accelerate would already have deleted checkpoint_0 to make room; here both complete
    # checkpoints stay until checkpoint_2 is in place.
    # (checkpoint_2 is being written under a hidden name that Accelerate orders first)
    visible = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert visible == ["checkpoint_0", "checkpoint_1"]
    assert all(listing(root / n) == ACCELERATE_FILES for n in visible)
    child.train(run, 6)
    ckpt.wait()
    assert sorted(os.listdir(root)) == ["checkpoint_1", "checkpoint_2"]
    ckpt.close()


@pytest.mark.parametrize("total_limit", [0, -1, 1])
def test_a_total_limit_below_one_keeps_the_newest_checkpoint_as_stock_does(tmp_path, total_limit):
    """Accelerate takes ``total_limit`` of 0 or less without complaint and, deleting the older
    checkpoints before each save, keeps the one it writes: GoCkpt, deleting after the publish,
    must keep that one too (it used to delete every checkpoint it wrote)."""
    names = {}
    for kind in ("stock", "gockpt"):
        run = child.build(str(tmp_path / kind), total_limit=total_limit)
        ckpt = attach(run.acc, GoCkptPlugin()) if kind == "gockpt" else None
        for batches in (1, 2, 3):
            child.train(run, batches)
            run.acc.save_state()
        if ckpt is not None:
            ckpt.close()
        names[kind] = sorted(os.listdir(tmp_path / kind / "checkpoints"))
    assert names["stock"] == ["checkpoint_2"]
    assert names["gockpt"] == names["stock"]
    assert listing(tmp_path / "gockpt" / "checkpoints" / "checkpoint_2") == ACCELERATE_FILES


def test_load_state_restores_the_iteration_counter(tmp_path):
    project = tmp_path / "run"
    run = child.build(str(project), total_limit=3)
    ckpt = attach(run.acc, GoCkptPlugin(mode="lazy"))
    for batches in (1, 2, 3):
        child.train(run, batches)
        run.acc.save_state()
    ckpt.close()
    fresh = child.build(str(project), seed=4, total_limit=3)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="lazy"))
    fresh.acc.load_state()  # automatic naming: the newest checkpoint
    assert fresh.progress.batches == 3
    assert fresh.acc.project_configuration.iteration == 3
    child.train(fresh, 5)
    assert fresh.acc.save_state().name == "checkpoint_3"  # no "already exists" error
    ckpt.close()
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_1", "checkpoint_2", "checkpoint_3"]


def test_iteration_is_restored_from_a_plain_accelerate_checkpoint(tmp_path):
    project = tmp_path / "run"
    run = child.build(str(project))
    child.train(run, 2)
    run.acc.save_state()
    run.acc.save_state()  # checkpoint_1, written by Accelerate itself
    fresh = child.build(str(project), seed=4)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    fresh.acc.load_state()
    assert fresh.acc.project_configuration.iteration == 2
    ckpt.close()


@pytest.mark.parametrize("skip_with", ["method", "function"])
def test_a_request_before_a_skipping_loader_begins_is_captured_at_its_end_with_its_rng(tmp_path, skip_with):
    # Requested at the last batch of an epoch; the next loader (skip_first_batches, one batch
    # left) begins after the request and holds the captured step: its end is the boundary.
    plugin = GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)
    [ours] = _augmented_run(tmp_path / "g", (32,), plugin, skip=(5, 31), stop=36, skip_with=skip_with)
    assert json.loads((ours / "gockpt.json").read_text())["captured_step"] == 33 - 5
    [stock] = _augmented_run(tmp_path / "s", (33,), skip=(5, 31), stop=36, skip_with=skip_with)
    assert child.differences(load_file(ours / "model.safetensors"),
                             load_file(stock / "model.safetensors"), "model") == []
    a, b = (torch.load(p / "random_states_0.pkl", weights_only=False) for p in (ours, stock))
    assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"])


@pytest.mark.parametrize("skip_with", ["method", "function"])
def test_a_multi_step_checkpoint_captured_at_the_end_of_a_resumed_epoch_holds_its_rng(tmp_path, skip_with):
    # A resumed run's first epoch goes through skip_first_batches, whose loader Accelerate
    # keeps nowhere: its end is still the boundary of the epoch's last step, not the next
    # epoch's first batch (after that epoch's iterator drew its seed from the RNG).
    plugin = GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)  # 2 tensors
    [ours] = _augmented_run(tmp_path / "g", (31,), plugin, skip=5, stop=36, skip_with=skip_with)
    updates = json.loads((ours / "gockpt.json").read_text())["captured_step"]
    assert updates == 32 - 5  # the last batch of the resumed epoch (32 batches an epoch)
    [stock] = _augmented_run(tmp_path / "s", (32,), skip=5, stop=36)
    assert child.differences(load_file(ours / "model.safetensors"),
                             load_file(stock / "model.safetensors"), "model") == []
    a, b = (torch.load(p / "random_states_0.pkl", weights_only=False) for p in (ours, stock))
    assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"])
    assert a["random_state"] == b["random_state"]


def test_a_loader_hooked_for_a_save_is_not_kept_alive_by_it(tmp_path):
    # Stock frees a skip_first_batches loader (and its worker processes) once the script
    # drops it; the step-boundary hooks a save put on it do not keep it.
    import gc
    import weakref

    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    loader = run.acc.skip_first_batches(run.dl, 1)
    for x, y in loader:
        with run.acc.accumulate(run.model):
            run.acc.backward(torch.nn.functional.mse_loss(run.model(x), y))
            run.opt.step()
            run.opt.zero_grad()
        run.acc.save_state()
        break
    assert "_update_state_dict" in vars(loader)  # hooked at the request
    ckpt.wait()
    gone = weakref.ref(loader)
    gc.disable()  # freed by its reference count, as under stock: no cycle through the hooks
    try:
        del loader, x, y
        assert gone() is None
    finally:
        gc.enable()
    ckpt.close()


@pytest.mark.parametrize(("writer", "damage"), [("gockpt", "flipped_byte"), ("gockpt", "truncated"),
                                                ("gockpt", "fifo"), ("accelerate", "fifo"),
                                                ("gockpt_hooked", "flipped_byte"), ("gockpt_hooked", "none")])
def test_load_state_refuses_a_damaged_folder_and_loads_nothing(tmp_path, writer, damage):
    # Accelerate's loader checks no checksum (a flipped bit in model.safetensors loads as a
    # wrong weight) and opens a FIFO as a file (blocking forever). A folder GoCkpt wrote is
    # checked against its manifest first; in any folder a FIFO is refused (a folder Accelerate
    # wrote has no manifest to check bytes against).
    # "gockpt_hooked": with a save_state pre-hook, model.safetensors is written from the
    # weights the hooks left (no tensor index): checked by its checksum.
    hooked = writer == "gockpt_hooked"
    project = tmp_path / "run"
    run = child.build(str(project))
    ckpt = attach(run.acc, GoCkptPlugin(mode="sync")) if writer != "accelerate" else None
    if hooked:
        run.acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    child.train(run, 2)
    folder = run.acc.save_state()
    if ckpt is not None:
        ckpt.close()
    model_file = Path(folder) / "model.safetensors"
    if damage == "none":  # intact: verified and loaded
        assert verify_checkpoint(str(folder)) == []
        fresh = child.build(str(project), seed=4)
        ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
        fresh.acc.load_state(folder)
        assert child.digest(fresh) == child.digest(run)
        ckpt.close()
        return
    if damage == "flipped_byte":
        data = bytearray(model_file.read_bytes())
        data[-3] ^= 0x10  # inside the last tensor's bytes
        model_file.write_bytes(bytes(data))
    elif damage == "truncated":
        with open(model_file, "r+b") as f:
            f.truncate(model_file.stat().st_size - 4)
    else:
        model_file.unlink()
        os.mkfifo(model_file)
    fresh = child.build(str(project), seed=4)
    before = child.digest(fresh)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    if hooked:
        fresh.acc.register_save_state_pre_hook(lambda models, weights, output_dir: None)
    with pytest.raises(gockpt.CheckpointCorruptError, match="model.safetensors"):
        fresh.acc.load_state(folder)
    assert child.digest(fresh) == before  # nothing was loaded
    ckpt.close()


def test_load_state_checks_and_numbers_a_folder_named_from_the_home_directory(tmp_path, monkeypatch):
    # Accelerate's load_state expands "~" itself: the folder checked against its manifest, and
    # whose iteration is restored, is that same one.
    monkeypatch.setenv("HOME", str(tmp_path))
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="sync"))
    child.train(run, 2)
    folder = Path(run.acc.save_state())
    ckpt.close()
    home_path = "~/" + str(folder.relative_to(tmp_path))
    fresh = child.build(str(tmp_path / "other"), seed=4)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    fresh.acc.load_state(home_path)
    assert child.digest(fresh) == child.digest(run)
    assert fresh.acc.project_configuration.iteration == 1  # checkpoint_0's, plus one
    ckpt.close()
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-3] ^= 0x10
    (folder / "model.safetensors").write_bytes(bytes(data))
    fresh = child.build(str(tmp_path / "other"), seed=4)
    before = child.digest(fresh)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    with pytest.raises(gockpt.CheckpointCorruptError, match="model.safetensors"):
        fresh.acc.load_state(home_path)
    assert child.digest(fresh) == before
    ckpt.close()


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_an_exception_between_the_update_and_the_scheduler_step_leaves_no_torn_folder(tmp_path, caplog, mode):
    # checkpoint_1 (requested after batch 2) is captured two updates later; batch 3's update
    # runs and its scheduler step does not (the loop raises in between), and close() finishes
    # the saves in flight. The weights are a step ahead of the scheduler there: checkpoint_1
    # is not written (a warning); checkpoint_0, requested and captured before, stands.
    project = tmp_path / "run"
    run = child.build(str(project))
    ckpt = attach(run.acc, GoCkptPlugin(mode=mode, min_overlap_steps=3, max_overlap_steps=3,
                                        host_buffer_bytes=1 << 24, exact_step=False))
    child.train(run, 1)
    first = run.acc.save_state()
    ckpt.wait()  # checkpoint_0: captured and published
    child.train(run, 2)
    second = run.acc.save_state()
    with pytest.raises(RuntimeError, match="scheduler"), caplog.at_level("WARNING", logger="gockpt"):
        try:
            for x, y in run.dl:  # the loader's next batch: a step boundary
                run.acc.backward(torch.nn.functional.mse_loss(run.model(x), y))
                run.opt.step()
                raise RuntimeError("the scheduler step failed")
        finally:
            ckpt.close()
    assert any("checkpoint_1: not written" in r.getMessage() for r in caplog.records)
    assert sorted(os.listdir(project / "checkpoints")) == ["checkpoint_0"]
    assert Path(first).name == "checkpoint_0" and Path(second).name == "checkpoint_1"


def test_a_capture_forced_inside_the_next_iteration_holds_step_and_rng_of_its_step(tmp_path):
    # checkpoint_0 (requested after batch 2) is to be captured two updates later. The next
    # iteration enters accumulate() (Accelerator.step moves on) and runs a forward with
    # dropout (the RNG moves on), then fails before its update; close() captures the save
    # there. Its step and RNG states are those at batch 2's end, as stock's save_state
    # there writes them, not the moved ones.
    project = tmp_path / "run"
    run = child.build(str(project))
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3,
                                        exact_step=False))
    child.train(run, 2)
    run.acc.save_state()
    want_step, want_rng = run.acc.step, torch.get_rng_state()
    with pytest.raises(RuntimeError, match="before the update"):
        try:
            for x, y in run.dl:
                with run.acc.accumulate(run.model):
                    run.acc.backward(torch.nn.functional.mse_loss(run.model(x), y))
                    raise RuntimeError("the loop failed before the update")
        finally:
            ckpt.close()
    assert run.acc.step != want_step and not torch.equal(torch.get_rng_state(), want_rng)
    folder = project / "checkpoints" / "checkpoint_0"
    assert json.loads((folder / "gockpt.json").read_text())["captured_step"] == 2
    states = torch.load(folder / "random_states_0.pkl", weights_only=False)
    assert states["step"] == want_step
    assert torch.equal(states["torch_manual_seed"], want_rng)


def test_explicit_output_dir_is_replaced_whole(tmp_path, reference):
    live = reference(1)
    run = child.build(str(tmp_path / "run"), automatic_naming=False)
    plugin = GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)
    ckpt = attach(run.acc, plugin)
    target = tmp_path / "latest"

    def on_batch_end(r):
        if r.progress.batches <= 3:
            r.acc.save_state(target)

    child.train(run, 4, on_batch_end=on_batch_end)
    ckpt.wait()
    # Three saves of one folder overlapped; the newest request is what stays.
    assert json.loads((target / "gockpt.json").read_text())["requested_step"] == 3
    assert listing(target) == ACCELERATE_FILES
    assert os.listdir(tmp_path) == ["latest"]  # no staging left beside it
    ckpt.close()
    assert _assert_resumes_exactly(target, live, use_gockpt=True) == 4


def test_a_folder_accelerate_wrote_itself_is_replaced_and_one_with_other_files_is_kept(
        tmp_path, reference):
    # Switching GoCkpt on in a run whose output folder holds Accelerate's own checkpoint: the
    # save replaces it, as stock's would write over it. A folder that also holds someone's
    # other files is refused (a save replaces the folder whole) and left as it was.
    live = reference(1)
    run = child.build(str(tmp_path / "run"), automatic_naming=False)
    child.train(run, 2)
    stock, other = tmp_path / "out", tmp_path / "other"
    run.acc.save_state(str(stock))  # Accelerate itself
    run.acc.save_state(str(other))
    (other / "README.txt").write_text("notes")
    before = {n: (other / n).read_bytes() for n in os.listdir(other)}
    assert "manifest.json" not in os.listdir(stock)
    ckpt = attach(run.acc, GoCkptPlugin(mode="sync"))
    with pytest.raises(FileExistsError, match="README.txt"):
        run.acc.save_state(str(other))
    assert {n: (other / n).read_bytes() for n in os.listdir(other)} == before
    run.acc.save_state(str(stock))
    ckpt.close()
    assert sorted(n for n in os.listdir(tmp_path) if "gockpt" in n) == []  # no staging left
    assert gockpt.is_complete(str(stock)) and listing(stock) == ACCELERATE_FILES
    assert _assert_resumes_exactly(stock, live, use_gockpt=True) == 2


class _Augmented(torch.utils.data.Dataset):
    """Samples with random augmentation: every fetch draws from the torch RNG."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)) + 0.1 * torch.randn(4)


def _augmented_run(project_dir, save_after, plugin=None, *, skip=0, stop=12, skip_with="method"):
    """Train on :class:`_Augmented` from batch ``skip + 1`` (a resumed run: the first epoch
    through ``accelerator.skip_first_batches``, or ``accelerate.skip_first_batches`` with
    ``skip_with="function"``; a tuple: one such loader per skip, then the plain one) to batch
    ``stop``; ``save_state`` after each batch number in ``save_after``; the folders."""
    import accelerate
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(
        project_dir=str(project_dir), automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    dl = torch.utils.data.DataLoader(_Augmented(), batch_size=2)
    model, opt, dl = acc.prepare(model, opt, dl)
    ckpt = attach(acc, plugin) if plugin is not None else None
    paths = []
    skipper = acc.skip_first_batches if skip_with == "method" else accelerate.skip_first_batches
    skips = skip if isinstance(skip, tuple) else (skip,)
    n = skips[0]
    for loader in [*(skipper(dl, k) for k in skips), dl] if skip else [dl]:
        for x in loader:
            with acc.accumulate(model):
                model(x).pow(2).mean().backward()
                opt.step()
                opt.zero_grad()
            n += 1
            if n in save_after:
                paths.append(acc.save_state())
            if n == stop:
                break
        if n == stop:
            break
    if ckpt is not None:
        ckpt.close()
    return paths


def test_a_multi_step_checkpoint_takes_rng_and_loader_state_of_its_captured_step(tmp_path):
    # The loader fetches one batch ahead and the dataset draws random augmentation: the RNG
    # state a multi-step checkpoint holds must be the one a stock save_state after its captured
    # batch holds, not one batch later (taken after the loop asked for the next batch).
    [ours] = _augmented_run(tmp_path / "g", (5,), GoCkptPlugin(mode="gockpt_o", min_overlap_steps=3,
                                                               max_overlap_steps=3))
    step = json.loads((ours / "gockpt.json").read_text())["captured_step"]
    assert step > 5
    [stock] = _augmented_run(tmp_path / "s", (step,))
    assert child.differences(load_file(ours / "model.safetensors"),
                             load_file(stock / "model.safetensors"), "model") == []
    a, b = (torch.load(p / "random_states_0.pkl", weights_only=False) for p in (ours, stock))
    assert torch.equal(a["torch_manual_seed"], b["torch_manual_seed"])
    assert a["random_state"] == b["random_state"]


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_weights_edited_inside_the_copy_windows_are_in_the_weights_file(tmp_path, mode):
    # A write through .data between updates while a multi-step save copies its blocks: the
    # capture takes the edited tensors live, but model.safetensors (written from the host slot)
    # held their copies from before the edit; a checkpoint of no step the run went through.
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode=mode, min_overlap_steps=3, max_overlap_steps=3))
    live, paths = {}, []

    def on_batch_end(run):
        b = run.progress.batches
        if b in (5, 6):  # after the update, inside the windows of the save requested at 4
            with torch.no_grad():
                for p in run.model.parameters():
                    p.data.mul_(0.99)
        live[b] = {k: v.clone() for k, v in run.acc.get_state_dict(run.model, unwrap=False).items()}
        if b == 4:
            paths.append(run.acc.save_state())

    child.train(run, 9, on_batch_end=on_batch_end)
    ckpt.wait()
    ckpt.close()
    step = json.loads((paths[0] / "gockpt.json").read_text())["captured_step"]
    assert step == 6  # K = 3 from the request at 4
    assert child.differences(load_file(str(paths[0] / "model.safetensors")), live[step], "model") == []


def test_a_failing_save_state_pre_hook_fails_save_state_as_stock(tmp_path):
    def broken(models, weights, output_dir):
        raise OSError(28, "No space left on device", output_dir)

    run = child.build(str(tmp_path / "run"))
    run.acc.register_save_state_pre_hook(broken)
    ckpt = attach(run.acc, GoCkptPlugin(mode="async"))
    child.train(run, 2)
    with pytest.raises(OSError, match="No space left"):  # its own type, from save_state
        run.acc.save_state()
    child.train(run, 3)  # training goes on
    ckpt.close()
    assert os.listdir(tmp_path / "run" / "checkpoints") == []  # no folder, no staging left


def test_model_file_is_safetensors_with_accelerate_keys(tmp_path):
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="sync"))
    child.train(run, 2)
    path = run.acc.save_state()
    ckpt.close()
    weights = load_file(str(path / "model.safetensors"))
    want = run.acc.get_state_dict(run.model, unwrap=False)
    assert child.differences(weights, dict(want)) == []
    assert torch.load(path / "optimizer.bin", weights_only=True)["param_groups"][0]["lr"] > 0


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_files_load_bit_identical_to_the_ones_accelerate_writes(tmp_path, safe_serialization):
    """optimizer.bin (and pytorch_model.bin), written from the snapshot by gockpt.torchfile,
    load, with weights_only=True as Accelerate loads them, to what stock save_state wrote."""
    run = child.build(str(tmp_path / "run"), automatic_naming=False)
    child.train(run, 3)
    run.acc.save_state(str(tmp_path / "stock"), safe_serialization=safe_serialization)  # Accelerate's
    ckpt = attach(run.acc, GoCkptPlugin(mode="async"))  # written on the persist thread
    run.acc.save_state(str(tmp_path / "ours"), safe_serialization=safe_serialization)
    ckpt.close()
    weights = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    for name in ("optimizer.bin", weights):
        if name.endswith(".safetensors"):
            ours, stock = load_file(str(tmp_path / "ours" / name)), load_file(str(tmp_path / "stock" / name))
        else:
            ours = torch.load(tmp_path / "ours" / name, weights_only=True)
            stock = torch.load(tmp_path / "stock" / name, weights_only=True)
        assert child.differences(ours, stock, name) == []
        if name.endswith(".safetensors"):
            continue  # its tensors lie in the file in an order of safetensors' own
        assert list(ours) == list(stock)  # the order of the keys too
        if name == "optimizer.bin":
            assert list(ours["state"]) == list(stock["state"])
            assert ours["param_groups"] == stock["param_groups"]
    # Plain load_state of either folder gives the same state, bit for bit.
    states = []
    for folder in ("ours", "stock"):
        fresh = child.build(str(tmp_path / f"resume-{folder}"), seed=3)
        fresh.acc.load_state(str(tmp_path / folder))
        states.append(child.snapshot(fresh))
    assert child.differences(states[0], states[1]) == []


def test_a_parameter_in_two_optimizers_is_refused_at_attach_and_stock_stays(tmp_path):
    from accelerate import Accelerator

    model = torch.nn.Linear(4, 2)
    first = torch.optim.AdamW(model.parameters(), lr=0.1)
    second = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = Accelerator(cpu=True)
    acc.prepare(model, first, second)
    with pytest.raises(NotImplementedError, match="more than one optimizer|several"):
        attach(acc, GoCkptPlugin(mode="lazy"))
    assert "save_state" not in vars(acc)  # Accelerate's own save_state is left in place


def test_detach_restores_accelerate_methods(tmp_path):
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="sync"))
    assert run.acc.save_state == ckpt.save_state
    with pytest.raises(RuntimeError, match="already attached"):
        attach(run.acc, GoCkptPlugin(mode="sync"))
    ckpt.close()
    assert "save_state" not in vars(run.acc) and "load_state" not in vars(run.acc)


def test_plugin_prefers_arguments_then_environment_then_file(tmp_path, monkeypatch):
    yaml_file = tmp_path / "gockpt.yaml"
    yaml_file.write_text("mode: lazy\nmax_inflight: 3\nnum_io_threads: 2\nchunk_bytes: '8_192'\n")
    monkeypatch.setenv("GOCKPT_CONFIG_FILE", str(yaml_file))
    monkeypatch.setenv("GOCKPT_MAX_INFLIGHT", "4")
    monkeypatch.setenv("GOCKPT_MODE", "gockpt")
    p = GoCkptPlugin(mode="sync")
    assert (p.mode, p.max_inflight, p.num_io_threads, p.chunk_bytes) == ("sync", 4, 2, 8192)
    config = p.to_config()
    assert config.max_overlap_steps == gockpt.GoCkptConfig().max_overlap_steps
    assert config.update_latest is False
    json_file = tmp_path / "gockpt.json"
    json_file.write_text(json.dumps({"when_full": "skip", "enabled": False}))
    monkeypatch.delenv("GOCKPT_MODE")
    p = GoCkptPlugin(config_file=str(json_file))
    # An explicit file wins over GOCKPT_CONFIG_FILE; the environment still wins over both.
    assert (p.mode, p.when_full, p.enabled, p.max_inflight) == (None, "skip", False, 4)


@pytest.mark.parametrize("env, value, match", [
    ("GOCKPT_MAX_INFLIGHT", "many", "GOCKPT_MAX_INFLIGHT"),
    ("GOCKPT_ENABLED", "perhaps", "GOCKPT_ENABLED"),
    ("GOCKPT_MODE", "bogus", "mode"),
    ("GOCKPT_MAX_INFLIGHT", "0", "max_inflight"),
])
def test_plugin_rejects_bad_environment(monkeypatch, env, value, match):
    monkeypatch.setenv(env, value)
    with pytest.raises(ValueError, match=match):
        GoCkptPlugin()


def test_plugin_rejects_unknown_config_key(tmp_path):
    f = tmp_path / "gockpt.yml"
    f.write_text("mode: sync\nmax_overlap: 3\n")
    with pytest.raises(ValueError, match="max_overlap"):
        GoCkptPlugin(config_file=str(f))


def test_disabled_plugin_leaves_accelerate_alone(tmp_path, monkeypatch):
    monkeypatch.setenv("GOCKPT_ENABLED", "0")
    run = child.build(str(tmp_path / "run"))
    assert attach(run.acc) is None
    assert "save_state" not in vars(run.acc)


@pytest.mark.parametrize("mode", ["gockpt", "sync"])
def test_two_processes_under_accelerate_launch(tmp_path, mode):
    # sync: the main process's blocking save must not wait inside the request for the other
    # process's share, which that process writes only once the request is exchanged.
    # No user accelerate config may leak in; "--multi_gpu" is how accelerate launch starts
    # several processes (torchrun), which Accelerator(cpu=True) runs on gloo.
    # Hidden GPUs: with one visible, Accelerate's barrier would name a CUDA device per rank.
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "HF_HOME": str(tmp_path / "hf"),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
           "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           "--main_process_port", str(_free_port()),
           str(_HERE / "test_accelerate_child.py"), "ddp", str(tmp_path), mode]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    results = [json.loads((tmp_path / f"result_{r}.json").read_text()) for r in (0, 1)]
    for res in results:
        assert res["errors"] == [], res
        assert res["names"] == ["checkpoint_3", "checkpoint_4"]  # total_limit=2
    assert results[0]["resumed_batches"] == results[1]["resumed_batches"]
    for name in results[0]["names"]:
        files = set(os.listdir(tmp_path / "checkpoints" / name))
        assert {"random_states_0.pkl", "random_states_1.pkl", "model.safetensors"} <= files
        keys = load_file(str(tmp_path / "checkpoints" / name / "model.safetensors")).keys()
        # Accelerate keeps the model it was given in _models (DDP wraps it afterwards) and
        # saves that one's keys.
        assert keys and not any(k.startswith("module.") for k in keys)
    r0 = torch.load(tmp_path / "checkpoints" / "checkpoint_4" / "random_states_0.pkl", weights_only=False)
    r1 = torch.load(tmp_path / "checkpoints" / "checkpoint_4" / "random_states_1.pkl", weights_only=False)
    assert not torch.equal(r0["torch_manual_seed"], r1["torch_manual_seed"])  # each rank its own


def test_save_state_pre_hooks_run_on_every_process_and_their_errors_are_raised(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "HF_HOME": str(tmp_path / "hf"),
           "CUDA_VISIBLE_DEVICES": ""}
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--multi_gpu",
           "--num_processes", "2", "--num_machines", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", str(_free_port()),
           str(_HERE / "test_accelerate_child.py"), "hooks", str(tmp_path)]
    proc = subprocess.run(cmd, env=env, cwd=str(tmp_path), capture_output=True, text=True, timeout=240)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "the pre-hook failed on process 1" in out, out[-3000:]
    assert "rank 1 passed the second save" not in out
    # Process 1's hook ran at both saves with the checkpoint folder, as stock passes it.
    assert json.loads((tmp_path / "hook_1.json").read_text()) == ["checkpoint_0", "checkpoint_1"]
    assert len(json.loads((tmp_path / "hook_0.json").read_text())) >= 1


def test_sigkill_during_save_leaves_a_checkpoint_that_load_state_resumes(tmp_path):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    proc = subprocess.Popen([sys.executable, str(_HERE / "test_accelerate_child.py"), "crash", str(tmp_path)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    digests: dict[int, str] = {}
    blocked = None
    seen: list[str] = []  # the child's output, for the failure message
    timer = threading.Timer(180, proc.kill)  # a hung child fails the test instead of hanging it
    timer.start()
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            seen.append(line)
            parts = line.split()
            if parts[:1] == ["state"]:
                digests[int(parts[1])] = parts[2]
            elif parts[:1] == ["blocked"]:
                blocked = parts[1]
                break
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(60)
    finally:
        timer.cancel()
    assert blocked is not None and "checkpoint_3" in blocked, (
        f"the child never reached the save (exit {proc.returncode}):\n" + "".join(seen[-60:]))
    root = tmp_path / "checkpoints"
    # checkpoint_3 was being written when the process died; total_limit=2 kept the last two
    # complete ones, which Accelerate's delete-first rotation would not have.
    visible = sorted(n for n in os.listdir(root) if not n.startswith("."))
    assert visible == ["checkpoint_1", "checkpoint_2"]
    assert any(n.startswith(".0-checkpoint_3") for n in os.listdir(root))  # the dead process's
    plain = child.build(str(tmp_path), seed=9, total_limit=2)
    plain.acc.load_state()  # Accelerate's own pick of the newest folder
    assert child.digest(plain) == digests[plain.progress.batches]
    fresh = child.build(str(tmp_path), seed=9, total_limit=2)
    ckpt = attach(fresh.acc, GoCkptPlugin(mode="sync"))
    fresh.acc.load_state()
    assert fresh.acc.project_configuration.iteration == 3
    child.train(fresh, fresh.progress.batches + 1)
    assert fresh.acc.save_state().name == "checkpoint_3"
    ckpt.close()
    assert sorted(os.listdir(root)) == ["checkpoint_2", "checkpoint_3"]  # dead process's files removed
    assert os.listdir(tmp_path) == ["checkpoints"] or ".gockpt-staging" not in os.listdir(tmp_path)


def test_tiny_llama_example_resumes_bit_identically(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    example = _load("gockpt_train_accelerate", _REPO / "examples" / "train_accelerate.py")
    monkeypatch.setenv("GOCKPT_MODE", "gockpt")
    monkeypatch.setenv("GOCKPT_MIN_OVERLAP_STEPS", "2")
    monkeypatch.setenv("GOCKPT_MAX_OVERLAP_STEPS", "2")
    common = ["--preset", "tiny", "--steps", "12", "--save-every", "4", "--log-every", "4", "--cpu"]
    from accelerate.state import AcceleratorState, GradientState

    def run(project, *extra):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        return example.run(example.parse_args(["--project-dir", str(project), *common, *extra]))

    straight = run(tmp_path / "a")
    assert [Path(p).name for p in straight.checkpoints] == ["checkpoint_0", "checkpoint_1", "checkpoint_2"]
    # Resume from checkpoint_1 (captured one update after its request at batch 8).
    (tmp_path / "b" / "checkpoints").mkdir(parents=True)
    os.rename(tmp_path / "a" / "checkpoints" / "checkpoint_1", tmp_path / "b" / "checkpoints" / "checkpoint_1")
    resumed = run(tmp_path / "b", "--resume")
    assert resumed.resumed_from == "checkpoint_1"
    assert child.differences(resumed.model_state, straight.model_state) == []
    assert resumed.losses[-1] == straight.losses[-1]


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_public_surface():
    assert set(accelerate_gockpt.__all__) == {"GoCkptCheckpointer", "GoCkptPlugin", "attach"}


@pytest.mark.parametrize("mode", ["async", "gockpt"])
def test_a_script_ending_with_save_state_leaves_the_checkpoint(tmp_path, mode):
    """Stock save_state is done when it returns; a script needs no end_training() for it."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    proc = subprocess.run([sys.executable, str(_HERE / "test_accelerate_child.py"), "exit", str(tmp_path), mode],
                          env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    path = tmp_path / "checkpoints" / "checkpoint_0"
    assert listing(path) == ACCELERATE_FILES
    plain = child.build(str(tmp_path), seed=9)
    plain.acc.load_state(str(path))
    assert child.digest(plain) == proc.stdout.split()[-1]


def test_save_state_pre_hooks_run_and_their_files_are_published(tmp_path):
    run = child.build(str(tmp_path / "run"))
    seen = []

    def hook(models, weights, output_dir):
        # As stock runs it: on the training thread, at save_state, with the live model.
        seen.append((len(models), sorted(weights[0]), threading.current_thread().name))
        weights[0].pop("out.bias")  # an edit of what is written, as stock allows
        Path(output_dir, "data.json").write_text(json.dumps({"note": 1}))
        torch.save({k: v.clone() for k, v in models[0].state_dict().items()},
                   Path(output_dir, "own.pt"))  # a model saved by the hook itself

    run.acc.register_save_state_pre_hook(hook)
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    child.train(run, 2)
    live = {k: v.clone() for k, v in run.acc.unwrap_model(run.model).state_dict().items()}
    path = run.acc.save_state()
    child.train(run, 4)
    ckpt.close()
    assert listing(path) == ACCELERATE_FILES | {"data.json", "own.pt"}
    assert seen and seen[0][0] == 1 and "out.bias" in seen[0][1]
    assert seen[0][2] == threading.current_thread().name
    saved = load_file(str(path / "model.safetensors"))
    assert "out.bias" not in saved
    own = torch.load(path / "own.pt")
    for k, v in live.items():  # the weights of the request, in both files
        assert torch.equal(own[k], v), k
        assert k == "out.bias" or torch.equal(saved[k], v), k
    sidecar = json.loads((path / "gockpt.json").read_text())
    assert sidecar["captured_step"] == sidecar["requested_step"]  # the step the hook saw


def test_save_state_follows_a_model_prepared_after_free_memory(tmp_path):
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="async"))
    child.train(run, 2)
    run.acc.save_state()
    run.acc.free_memory()
    torch.manual_seed(5)
    model = child.Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    model, opt = run.acc.prepare(model, opt)
    path = run.acc.save_state()
    ckpt.close()
    saved = load_file(str(path / "model.safetensors"))
    assert saved.keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        assert torch.equal(saved[k], v), k


@pytest.mark.parametrize("log_metrics", [True, False])
def test_published_checkpoints_reach_the_trackers_only_when_asked(tmp_path, log_metrics):
    from accelerate.tracking import GeneralTracker

    class Tracker(GeneralTracker):
        name = "memory"
        requires_logging_directory = False

        def __init__(self):
            super().__init__()
            self.logged = []

        @property
        def tracker(self):
            return self

        def store_init_configuration(self, values):
            pass

        def log(self, values, step=None, **kwargs):
            self.logged.append((dict(values), step))

    run = child.build(str(tmp_path / "run"))
    tracker = Tracker()
    run.acc.log_with = [tracker]
    run.acc.trackers = [tracker]
    ckpt = attach(run.acc, GoCkptPlugin(mode="async", log_metrics=log_metrics))
    child.train(run, 2)
    run.acc.save_state()
    child.train(run, 4)
    run.acc.save_state()
    ckpt.close()
    steps = [int(v["gockpt/requested_step"]) for v, _ in tracker.logged if "gockpt/stall_s" in v]
    assert steps == ([2, 4] if log_metrics else [])


def _one_overlapped_save(tmp_path):
    """A run with one K=2 save at update 2, trained on to 5 and closed: (checkpointer, path)."""
    run = child.build(str(tmp_path / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2))
    child.train(run, 2)
    path = run.acc.save_state()
    child.train(run, 5)
    ckpt.close()
    return ckpt, path


def test_each_checkpoint_is_written_once(tmp_path):
    """Accelerate's files come straight from the engine's snapshot: the bytes the save wrote
    are the bytes of the published folder (no engine copy rewritten a second time)."""
    ckpt, path = _one_overlapped_save(tmp_path)
    (m,) = ckpt.metrics
    published = sum(f.stat().st_size for f in path.iterdir())
    assert m.persist_bytes <= published <= 1.05 * m.persist_bytes
    assert os.listdir(tmp_path / "run") == ["checkpoints"]
    assert os.listdir(tmp_path / "run" / "checkpoints") == ["checkpoint_0"]


def test_tied_weights_are_stored_once_under_their_first_name(tmp_path):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.first = torch.nn.Linear(4, 4)
            self.second = torch.nn.Linear(4, 4)
            self.second.weight = self.first.weight

        def forward(self, x):
            return self.second(self.first(x))

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    model = Tied()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model, opt = acc.prepare(model, opt)
    ckpt = attach(acc, GoCkptPlugin(mode="lazy"))
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    acc.save_state(str(tmp_path / "ckpt"))
    ckpt.close()
    stored = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert sorted(stored) == ["first.bias", "first.weight", "second.bias"]
    assert torch.equal(stored["first.weight"], model.first.weight.detach())


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_an_unchanged_script_gets_gockpt_from_the_launch_command(tmp_path, enabled):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "GOCKPT_ENABLED": enabled,
           "GOCKPT_MODE": "gockpt", "GOCKPT_MIN_OVERLAP_STEPS": "2"}
    proc = subprocess.run([sys.executable, "-m", "accelerate_gockpt.run", str(_HERE / "test_accelerate_child.py"),
                           "plain", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attached, digest = proc.stdout.split()[-2:]
    path = tmp_path / "checkpoints" / "checkpoint_0"
    if enabled == "1":
        assert attached == "GoCkptCheckpointer"
        assert listing(path) == ACCELERATE_FILES
        assert json.loads((path / "gockpt.json").read_text())["mode"] == "gockpt"  # GOCKPT_MODE read
    else:
        assert attached != "GoCkptCheckpointer" and "gockpt.json" not in os.listdir(path)
    plain = child.build(str(tmp_path), seed=9)
    plain.acc.load_state(str(path))
    assert child.digest(plain) == digest


_SITE_START = """
import runpy, site, sys
site.addsitedir(sys.argv[1])  # as site-packages is read at start-up: runs gockpt-accelerate.pth
assert "torch" not in sys.modules and "accelerate" not in sys.modules, "the .pth imported them"
sys.argv = sys.argv[2:]
runpy.run_path(sys.argv[0], run_name="__main__")
"""


@pytest.mark.parametrize("enabled", ["1", "0"])
def test_gockpt_enabled_in_the_environment_attaches_gockpt_to_an_unchanged_script(tmp_path, enabled):
    """The installed .pth line (copied into a site dir here, as a wheel installs it) attaches
    GoCkpt at prepare when GOCKPT_ENABLED is true, and imports nothing otherwise."""
    site_dir = tmp_path / "site"
    site_dir.mkdir()
    (site_dir / "gockpt-accelerate.pth").write_text((_REPO / "gockpt-accelerate.pth").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO), "GOCKPT_ENABLED": enabled,
           "GOCKPT_MODE": "lazy"}
    proc = subprocess.run([sys.executable, "-c", _SITE_START, str(site_dir), str(_HERE / "test_accelerate_child.py"),
                           "plain", str(tmp_path)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr[-3000:]
    attached, digest = proc.stdout.split()[-2:]
    path = tmp_path / "checkpoints" / "checkpoint_0"
    assert (attached == "GoCkptCheckpointer") == (enabled == "1")
    assert ("gockpt.json" in os.listdir(path)) == (enabled == "1")
    plain = child.build(str(tmp_path), seed=9)
    plain.acc.load_state(str(path))
    assert child.digest(plain) == digest


def test_an_explicit_attach_replaces_the_automatic_one(tmp_path):
    script = tmp_path / "script.py"
    script.write_text(f"""
import torch
from accelerate import Accelerator
from accelerate_gockpt import GoCkptPlugin, attach
from gockpt.audit import describe_checkpoint, verify_checkpoint
from accelerate_gockpt.run import install
install()
acc = Accelerator(cpu=True)
model, opt = acc.prepare(torch.nn.Linear(4, 4), torch.optim.SGD(torch.nn.Linear(4, 4).parameters(), lr=0.1))
auto = acc.save_state.__self__
assert auto.automatic, "attached at prepare"
mine = attach(acc, GoCkptPlugin(mode="async"))
assert acc.save_state.__self__ is mine and not mine.automatic and auto._closed
try:
    attach(acc)
except RuntimeError as e:
    assert "already attached" in str(e)
else:
    raise AssertionError("a second explicit attach must be refused")
acc.save_state({str(tmp_path / 'ckpt')!r})
acc.end_training()
print("ok")
""")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(_REPO)}
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0 and proc.stdout.split()[-1] == "ok", proc.stderr[-3000:]
    assert "model.safetensors" in os.listdir(tmp_path / "ckpt")


def test_an_explicit_output_dir_does_not_claim_the_folder_around_it(tmp_path):
    """Another job writing checkpoints in the same parent folder does not block save_state(dir):
    only the automatic ``checkpoints/`` folder is claimed, as the run's own."""
    from writers import another_writer

    with another_writer(tmp_path):
        run = child.build(str(tmp_path / "run"), automatic_naming=False)
        ckpt = attach(run.acc, GoCkptPlugin(mode="async"))
        child.train(run, 2)
        run.acc.save_state(str(tmp_path / "mine"))
        ckpt.close()
        assert listing(tmp_path / "mine") == ACCELERATE_FILES


def test_the_cli_inspects_and_verifies_an_accelerate_checkpoint(tmp_path, capsys):
    from gockpt import cli

    _, path = _one_overlapped_save(tmp_path)
    capsys.readouterr()
    assert cli.main(["verify", str(path)]) == 0
    assert cli.main(["inspect", str(path)]) == 0
    out = capsys.readouterr().out
    assert "written by AccelerateWriter" in out and "1 holding tensors" in out
    (path / "optimizer.bin").write_bytes(b"torn")  # a writer's own file is checksummed too
    assert cli.main(["verify", str(path)]) == 1
    assert "optimizer.bin" in capsys.readouterr().out


@pytest.mark.parametrize("mode", ["async", "gockpt"])
def test_a_project_dir_through_a_symlinked_parent_saves_and_refuses_a_second_save(tmp_path, mode):
    # The engine writes where the path names a directory at the request (parent symlinks
    # resolved); the adapter's staging folder keeps the symlinked spelling. Both name one
    # directory: the save must publish, and a second save_state of that folder while the
    # first is in flight must be refused, as for a plain path.
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    run = child.build(str(tmp_path / "link" / "run"))
    ckpt = attach(run.acc, GoCkptPlugin(mode=mode))
    child.train(run, 2)
    path = run.acc.save_state()
    handle = ckpt.saves[0]
    in_flight = not handle.done()
    assert in_flight or mode == "async"  # gockpt: K > 1 copy windows still open
    if in_flight:
        run.acc.project_configuration.iteration -= 1  # the same folder again
        with pytest.raises(ValueError, match="already exists"):
            run.acc.save_state()
        run.acc.project_configuration.iteration += 1
    child.train(run, 6)
    ckpt.close()
    assert handle.result().path == str(tmp_path.resolve() / "real" / "run" / "checkpoints"
                                       / "checkpoint_0")
    assert listing(path) == ACCELERATE_FILES
    assert listing(tmp_path / "real" / "run" / "checkpoints" / "checkpoint_0") == ACCELERATE_FILES


@pytest.mark.parametrize("safe_serialization", [True, False])
def test_buffers_no_shard_holds_are_saved_and_loaded_as_stock(tmp_path, safe_serialization):
    """A uint16 and a complex buffer (a token table, a rotary table): the host slot holds
    neither, so the weights file is built from the captured state instead; it holds what
    stock's holds, and ``load_state`` restores them (the save used to fail with a KeyError)."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from torch import nn

    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)
            self.register_buffer("ids", torch.arange(5).to(torch.uint16))
            self.register_buffer("freqs", torch.polar(torch.ones(4), torch.arange(4.0)))

        def forward(self, x):
            return self.lin(x) * (self.freqs.real + self.ids[:4].to(torch.int32))

    def run(out, gockpt_on):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        torch.manual_seed(0)
        acc = Accelerator(cpu=True)
        net = Odd()
        model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters(), lr=0.1))
        ckpt = attach(acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2)) if gockpt_on else None
        for i in range(3):
            model(torch.ones(2, 4) * i).sum().backward()
            opt.step()
            opt.zero_grad()
        acc.save_state(str(out), safe_serialization=safe_serialization)
        if ckpt is not None:
            ckpt.wait()
        return acc, model, ckpt

    run(tmp_path / "stock", False)
    acc, model, ckpt = run(tmp_path / "ours", True)
    name = "model.safetensors" if safe_serialization else "pytorch_model.bin"
    read = load_file if safe_serialization else (lambda p: torch.load(p, weights_only=True))
    ours, stock = read(tmp_path / "ours" / name), read(tmp_path / "stock" / name)
    assert ours.keys() == stock.keys() == {"lin.weight", "lin.bias", "ids", "freqs"}
    for k in stock:
        assert ours[k].dtype == stock[k].dtype and torch.equal(ours[k], stock[k]), k
    with torch.no_grad():
        model.ids.zero_()
        model.freqs.zero_()
    acc.load_state(str(tmp_path / "ours"))
    assert torch.equal(model.ids, stock["ids"]) and torch.equal(model.freqs, stock["freqs"])
    ckpt.close()


def test_a_save_finished_by_a_later_request_holds_step_and_rng_of_that_request(tmp_path):
    """Gradient accumulation (2), K = 3: saves requested at micro-steps 7 and 9; the second
    request finishes the first (no host slot for both), capturing it at micro-step 9. Its
    ``random_states_0.pkl`` held micro-step 8's ``step`` and RNG (the step's first boundary)
    beside micro-step 9's registered counter: no stock folder. Now both hold micro-step 9 as
    stock's save_state there does."""
    from accelerate import Accelerator
    from accelerate.utils import ProjectConfiguration, set_seed
    from torch import nn

    class Counter:
        def __init__(self):
            self.n = 0

        def state_dict(self):
            return {"n": self.n}

        def load_state_dict(self, sd):
            self.n = sd["n"]

    def run(root, plugin, save_at):
        set_seed(0)
        acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir=str(root)),
                          gradient_accumulation_steps=2)
        model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.2), nn.Linear(8, 1))
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        model, opt = acc.prepare(model, opt)
        ctr = Counter()
        acc.register_for_checkpointing(ctr)
        ckpt = attach(acc, plugin) if plugin is not None else None
        for _ in range(12):
            with acc.accumulate(model):
                x = torch.randn(5, 4, generator=torch.Generator().manual_seed(ctr.n))
                acc.backward((model(x) ** 2).mean())
                opt.step()
                opt.zero_grad()
            ctr.n += 1
            if ctr.n in save_at:
                acc.save_state(str(root / f"ck_{ctr.n}"))
        if ckpt is not None:
            ckpt.close()

    run(tmp_path / "stock", None, (9,))
    run(tmp_path / "ours", GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3), (7, 9))
    want = tmp_path / "stock" / "ck_9"
    for name in ("ck_7", "ck_9"):
        got = tmp_path / "ours" / name
        assert torch.load(got / "custom_checkpoint_0.pkl", weights_only=False) == {"n": 9}, name
        g = torch.load(got / "random_states_0.pkl", weights_only=False)
        w = torch.load(want / "random_states_0.pkl", weights_only=False)
        assert g["step"] == w["step"] == 9, name
        assert torch.equal(g["torch_manual_seed"], w["torch_manual_seed"]), name
        assert child.differences(load_file(str(got / "model.safetensors")),
                                 load_file(str(want / "model.safetensors"))) == [], name


@pytest.mark.parametrize("how", ["load_checkpoint_in_model", "assign"])
def test_a_frozen_submodule_reloaded_inside_the_windows_is_in_model_safetensors(tmp_path, how):
    # A frozen teacher refreshed from a file at a step inside a multi-step save's windows (new
    # Parameter objects): model.safetensors, built from the host slot, holds the refreshed
    # weights, as stock's save_state at the captured step does.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import load_checkpoint_in_model
    from safetensors.torch import save_file

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.student = torch.nn.Linear(16, 16)
            self.teacher = torch.nn.Linear(16, 16)
            self.teacher.requires_grad_(False)

        def forward(self, x):
            return self.student(x) + self.teacher(x)

    def run(ours: bool, root: Path) -> dict[int, Path]:
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        acc = Accelerator(cpu=True)
        torch.manual_seed(0)
        net = Net()
        model, opt = acc.prepare(net, torch.optim.AdamW(net.student.parameters(), lr=1e-2))
        root.mkdir()
        teacher_file = root / "teacher.safetensors"
        save_file({k: torch.full_like(v, 7.0) for k, v in net.teacher.state_dict().items()}, str(teacher_file))
        if ours:
            attach(acc, GoCkptPlugin(mode="gockpt", min_overlap_steps=3, max_overlap_steps=3))
        g = torch.Generator().manual_seed(1)
        saved = {}
        for step in range(1, 9):
            acc.backward(model(torch.randn(8, 16, generator=g)).pow(2).mean())
            opt.step()
            opt.zero_grad()
            if step == 6:
                if how == "assign":
                    net.teacher.load_state_dict(load_file(str(teacher_file)), assign=True)
                else:
                    load_checkpoint_in_model(net.teacher, str(teacher_file))
            if (step == 5) if ours else True:
                saved[step] = Path(acc.save_state(str(root / f"step{step}")))
        acc.end_training()
        return saved

    stock = run(False, tmp_path / "stock")
    ours = run(True, tmp_path / "ours")[5]
    captured = json.loads((ours / "gockpt.json").read_text())["captured_step"]
    assert captured > 5  # a step after the request's, at or after the refresh
    got, want = load_file(str(ours / "model.safetensors")), load_file(str(stock[captured] / "model.safetensors"))
    assert got.keys() == want.keys()
    assert [k for k in want if not torch.equal(got[k], want[k])] == []


@pytest.mark.parametrize("ours", [False, True], ids=["stock", "gockpt"])
def test_a_rollback_with_automatic_naming_saves_under_the_next_number_and_returns_stocks_path(
        tmp_path, monkeypatch, ours):
    # Roll back to an older checkpoint in the same process, train, save: stock's counter stays
    # where it was, so the save is checkpoint_4; save_state returns the folder as stock names
    # it (project_dir relative here, so the path is too).
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState
    from accelerate.utils import ProjectConfiguration

    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True, project_config=ProjectConfiguration(project_dir="proj",
                                                                    automatic_checkpoint_naming=True))
    torch.manual_seed(0)
    net = torch.nn.Linear(8, 8)
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters()))
    if ours:
        attach(acc, GoCkptPlugin(mode="lazy"))
    paths = []
    for _ in range(4):
        acc.backward(model(torch.randn(4, 8)).sum())
        opt.step()
        opt.zero_grad()
        paths.append(acc.save_state())
    assert paths == [Path("proj/checkpoints") / f"checkpoint_{i}" for i in range(4)]
    acc.load_state("proj/checkpoints/checkpoint_1")
    assert acc.project_configuration.iteration == 4
    acc.backward(model(torch.randn(4, 8)).sum())
    opt.step()
    assert acc.save_state() == Path("proj/checkpoints/checkpoint_4")
    acc.end_training()
    assert sorted(os.listdir("proj/checkpoints")) == [f"checkpoint_{i}" for i in range(5)]


@pytest.mark.parametrize("ours", [False, True], ids=["stock", "gockpt"])
def test_save_state_returns_a_relative_folder_as_given(tmp_path, monkeypatch, ours):
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    monkeypatch.chdir(tmp_path)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    net = torch.nn.Linear(8, 8)
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters()))
    if ours:
        attach(acc, GoCkptPlugin(mode="lazy"))
    assert acc.save_state("rel/ck") == Path("rel/ck")
    # Stock's save_state does not expand "~" (its load_state does): a folder named "~" here.
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert acc.save_state("~/ck") == Path("~/ck")
    acc.end_training()
    assert "model.safetensors" in os.listdir("rel/ck")
    assert "model.safetensors" in os.listdir(tmp_path / "~" / "ck")
    assert not (tmp_path / "home").exists()


def test_save_state_inside_a_folder_still_being_written_leaves_both(tmp_path):
    # save_state("ck") then save_state("ck/sub") at the next step, before ck is published:
    # stock writes both; the nested staging folder must not make ck's publish fail.
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    acc = Accelerator(cpu=True)
    torch.manual_seed(0)
    net = torch.nn.Linear(64, 64)
    model, opt = acc.prepare(net, torch.optim.AdamW(net.parameters()))
    attach(acc, GoCkptPlugin(exact_step=True))
    for step in range(4):
        acc.backward(model(torch.randn(8, 64)).sum())
        opt.step()
        opt.zero_grad()
        if step == 1:
            acc.save_state(str(tmp_path / "ck"))
        if step == 2:
            acc.save_state(str(tmp_path / "ck" / "sub"))
    acc.end_training()
    for folder in (tmp_path / "ck", tmp_path / "ck" / "sub"):
        assert {"model.safetensors", "optimizer.bin"} <= set(os.listdir(folder))
    assert "sub" in os.listdir(tmp_path / "ck")
