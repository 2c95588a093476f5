"""Resume equivalence for Lightning features, one at a time (issue: Lightning fidelity).

Each case trains once without interruption with stock Lightning, and once with ``GoCkptIO``
stopped early and resumed from a GoCkpt checkpoint; the final weights and optimizer state must
be equal bit for bit. The multi-step modes run with K forced to 3, so that the features' own
events (an unfreeze, a new param group, an epoch end, weights swapped by a callback) fall inside
a checkpoint's copy windows.
"""

from __future__ import annotations

import lightning.pytorch as pl
import pytest
import torch
from _lightning_train import assert_bitwise_equal
from lightning.pytorch.callbacks import EMAWeightAveraging, ModelCheckpoint
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import gockpt
from lightning_gockpt import GoCkptIO

MODES = ("lazy", "gockpt", "gockpt_o")
BATCHES = 8  # per epoch


class Net(pl.LightningModule):
    """A small regression net; ``feature`` switches on one Lightning feature."""

    def __init__(self, feature: str = "plain") -> None:
        super().__init__()
        self.feature = feature
        if feature == "channels_last":
            self.conv = nn.Conv2d(2, 4, 3, padding=1)
            self.conv.to(memory_format=torch.channels_last)
        self.body = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 8))
        if feature in ("batch_norm", "batch_end_forward"):  # statistics move in every training forward
            self.body = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 8))
            # Moved in training_step, outside any forward.
            self.register_buffer("batches_seen", torch.zeros((), dtype=torch.long))
        self.extra = nn.Linear(8, 8)  # frozen until step 5, or in a param group added at step 5
        if feature in ("unfreeze", "add_param_group"):
            self.extra.requires_grad_(False)
        self.automatic_optimization = feature not in ("manual", "shared")
        if feature == "complex":  # tensors no safetensors shard holds (a rotary table)
            self.rot = nn.Parameter(torch.polar(torch.ones(8), torch.linspace(0, 1, 8)))
            self.register_buffer("freqs", torch.polar(torch.ones(8), torch.arange(8.0)))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.body(x)
        if self.feature == "complex":
            y = y * (self.rot * self.freqs).real
        if self.feature == "channels_last":
            img = x[:, :8].reshape(-1, 2, 2, 2).contiguous(memory_format=torch.channels_last)
            y = y + self.conv(img).mean()
        return y + self.extra(x)

    def training_step(self, batch, batch_idx):
        if self.feature == "raise" and self.global_step == 7:
            raise _Crash("step 8 fails")
        if self.feature == "clamp_in_step":
            self._clamp()
        if hasattr(self, "batches_seen"):
            self.batches_seen += 1
        x, t = batch
        loss = (self(x) - t).pow(2).mean()
        if self.automatic_optimization:
            return loss
        if self.feature == "shared":  # two optimizers update the same parameters
            for opt in self.optimizers():
                opt.zero_grad()
                self.manual_backward((self(x) - t).pow(2).mean())
                opt.step()
            return None
        opt = self.optimizers()
        for _ in range(2):  # two updates per batch
            opt.zero_grad()
            self.manual_backward((self(x) - t).pow(2).mean())
            opt.step()
        return None

    def _clamp(self) -> None:
        """A weight constraint applied in place outside optimizer.step() (max-norm style)."""
        with torch.no_grad():
            for p in self.parameters():
                p.clamp_(-0.3, 0.3)

    def on_train_batch_end(self, outputs, batch, batch_idx):
        # Runs after the callbacks' on_train_batch_end, where ModelCheckpoint requested a save.
        if self.feature == "module_save" and self.global_step in (2, 5):
            # After GoCkpt's batch end: a later step's request (ModelCheckpoint, a callback)
            # comes after that step's update and before GoCkpt's batch end of it.
            self.trainer.save_checkpoint(f"{self.trainer.default_root_dir}/module-{self.global_step}.ckpt")
        if self.feature == "clamp_after_batch":
            self._clamp()
        if self.feature == "edit_at_capture" and self.global_step == 6:
            # Once, at the batch end where the save requested at step 4 is captured (K = 3),
            # after GoCkpt's callback took its step (a one-off re-initialisation).
            with torch.no_grad():
                self.body[-1].weight.fill_(0.01)
        if self.feature in ("clamp_late", "data_clamp_late") and self.global_step >= 5:
            # From step 5 on, inside the copy windows of the save requested at step 4: in place
            # (the version counters move), or through .data, WGAN style (they do not).
            with torch.no_grad():
                for p in self.parameters():
                    (p.data if self.feature == "data_clamp_late" else p).clamp_(-0.3, 0.3)

    def on_before_optimizer_step(self, optimizer):
        # Runs after GoCkpt's callback ended the copy window, right before the update.
        if self.feature == "data_before_update_late" and self.global_step >= 5:
            for p in self.parameters():
                p.data.mul_(0.999)

    def on_train_batch_start(self, batch, batch_idx):
        if self.feature == "skip_epoch" and self.current_epoch == 0 and self.global_step == 6:
            return -1  # the rest of epoch 0 is skipped
        if self.global_step >= 5 and not self.extra.weight.requires_grad:
            self.extra.requires_grad_(True)
            if self.feature == "add_param_group":
                self.optimizers().optimizer.add_param_group({"params": list(self.extra.parameters()), "lr": 0.02})

    def configure_optimizers(self):
        if self.feature == "shared":
            return [torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01),
                    torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)]
        params = [p for n, p in self.named_parameters()
                  if not (self.feature == "add_param_group" and n.startswith("extra."))]
        return torch.optim.AdamW(params, lr=0.05, weight_decay=0.01)

    def train_dataloader(self):
        g = torch.Generator().manual_seed(7)
        x = torch.randn(BATCHES * 4, 8, generator=g)
        if self.feature == "plain":  # a DataLoader that cannot resume mid-epoch
            return DataLoader(TensorDataset(x, x.flip(1)), batch_size=4, shuffle=False)
        return _Resumable(x)


class _Crash(RuntimeError):
    pass


class _StopAt(pl.Callback):
    """Stops the run at the end of step ``step``, mid-epoch, as a ``Timer`` does (``late``: at
    the batch end after it, inside the next accumulation)."""

    def __init__(self, step: int, late: bool = False) -> None:
        self.step, self.late, self.seen = step, late, 0

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step == self.step:
            self.seen += 1
            if self.seen == (2 if self.late else 1):
                trainer.should_stop = True


class _ForwardAtBatchEnd(pl.Callback):
    """A train-mode forward in on_train_batch_end (before ModelCheckpoint's): a logged metric."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        with torch.no_grad():
            pl_module(batch[0])


class _SaveEvery(pl.Callback):
    """Saves ``every.ckpt`` at every batch end (before the module's on_train_batch_end)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        trainer.save_checkpoint(f"{trainer.default_root_dir}/every.ckpt")


class _Resumable:
    """Batches of 4 in a fixed order, with a position Lightning checkpoints (resumes mid-epoch)."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x, self.pos = x, 0

    def __len__(self) -> int:
        return BATCHES

    def __iter__(self):
        if self.pos >= BATCHES:
            self.pos = 0
        while self.pos < BATCHES:
            b = self.x[self.pos * 4:(self.pos + 1) * 4]
            self.pos += 1
            yield b, b.flip(1)

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


def _state(trainer: pl.Trainer, model: Net) -> dict:
    opt = trainer.optimizers[0]
    return {"model": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "optim": opt.state_dict(), "step": trainer.global_step}


def _run(root, feature, *, io=None, ckpt_path=None, max_steps=-1, max_epochs=None, callbacks=(),
         ckpt_every_steps=None, every_epoch=False, precision="32-true", accumulate=1):
    pl.seed_everything(0, verbose=False)
    model = Net(feature)
    cbs = [*callbacks]
    if ckpt_every_steps or every_epoch:
        cbs.append(ModelCheckpoint(dirpath=str(root), filename="{step}", save_top_k=-1,
                                   every_n_train_steps=ckpt_every_steps,
                                   every_n_epochs=1 if every_epoch else None))
    trainer = pl.Trainer(default_root_dir=str(root), max_steps=max_steps, max_epochs=max_epochs,
                         accelerator="cpu", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=bool(cbs),
                         precision=precision, callbacks=cbs, plugins=[io] if io else None,
                         num_sanity_val_steps=0, accumulate_grad_batches=accumulate)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


def _io(mode: str) -> GoCkptIO:
    k = 1 if mode == "lazy" else 3
    return GoCkptIO(mode=mode, min_overlap_steps=k, max_overlap_steps=k)


def _same_as_stock(ours_path, stock_path) -> None:
    """GoCkpt's checkpoint at ``ours_path`` holds what stock's file at ``stock_path`` does: the
    step, the weights and the optimizer state bit for bit, the loops' state."""
    ours = GoCkptIO().load_checkpoint(str(ours_path), weights_only=False)
    stock = torch.load(stock_path, weights_only=False)
    name = stock_path.name
    assert ours["global_step"] == stock["global_step"], name
    assert_bitwise_equal(ours["state_dict"], stock["state_dict"], name)
    assert_bitwise_equal(ours["optimizer_states"][0]["state"], stock["optimizer_states"][0]["state"], name)
    assert ours["loops"] == stock["loops"], name


def _same(a: dict, b: dict) -> None:
    assert a["step"] == b["step"]
    assert_bitwise_equal(a["model"], b["model"], "model")
    assert_bitwise_equal(a["optim"]["state"], b["optim"]["state"], "optimizer state")
    assert a["optim"]["param_groups"] == b["optim"]["param_groups"]


def _callbacks(feature: str) -> tuple:
    return (EMAWeightAveraging(decay=0.9),) if feature == "ema" else ()


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", ["ema", "channels_last", "unfreeze", "manual"])
def test_mid_epoch_checkpoint_resumes_exactly(tmp_path, mode, feature):
    """Checkpoint requested at step 4 (captured at 4..6), stopped at 8, resumed to 20."""
    total = 20
    ref = _state(*_run(tmp_path / "ref", feature, max_steps=total, callbacks=_callbacks(feature)))
    _run(tmp_path / "a", feature, io=_io(mode), max_steps=8, ckpt_every_steps=4,
         callbacks=_callbacks(feature))
    path = str(tmp_path / "a" / "step=4.ckpt")
    captured = gockpt.load_checkpoint(path, allow_pickle=True).captured_step
    if feature != "manual":  # manual optimization always holds the requested step
        assert captured == 4 + (0 if mode == "lazy" else 2)
    resumed = _state(*_run(tmp_path / "b", feature, io=_io(mode), max_steps=total, ckpt_path=path,
                           callbacks=_callbacks(feature)))
    _same(resumed, ref)


@pytest.mark.parametrize("mode", ["lazy", "gockpt_o"])
def test_optimizers_sharing_parameters_checkpoint_and_resume_as_stock(tmp_path, mode):
    """Two optimizers updating the same parameters (a layout GoCkpt cannot split into units):
    the checkpoint is taken whole at its request, equals stock's bit for bit, and resumes."""
    _run(tmp_path / "a", "shared", io=_io(mode), max_steps=8, ckpt_every_steps=4)
    _run(tmp_path / "s", "shared", max_steps=8, ckpt_every_steps=4)
    ours = GoCkptIO().load_checkpoint(str(tmp_path / "a" / "step=4.ckpt"), weights_only=False)
    stock = torch.load(tmp_path / "s" / "step=4.ckpt", weights_only=False)
    assert ours["global_step"] == stock["global_step"] == 4
    assert_bitwise_equal(ours["state_dict"], stock["state_dict"], "state_dict")
    assert_bitwise_equal(ours["optimizer_states"], stock["optimizer_states"], "optimizer_states")
    ref_trainer, ref_model = _run(tmp_path / "ref", "shared", max_steps=12)
    trainer, model = _run(tmp_path / "b", "shared", io=_io(mode), max_steps=12,
                          ckpt_path=str(tmp_path / "a" / "step=4.ckpt"))
    assert_bitwise_equal(model.state_dict(), ref_model.state_dict(), "model")
    assert_bitwise_equal([o.state_dict() for o in trainer.optimizers],
                         [o.state_dict() for o in ref_trainer.optimizers], "optimizers")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_end_of_epoch_checkpoint_with_a_plain_dataloader_resumes_exactly(tmp_path, mode, precision):
    """ModelCheckpoint's default trigger (epoch end) with a DataLoader that cannot resume mid-epoch."""
    ref = _state(*_run(tmp_path / "ref", "plain", max_epochs=3, precision=precision))
    _run(tmp_path / "a", "plain", io=_io(mode), max_epochs=2, every_epoch=True, precision=precision)
    path = str(tmp_path / "a" / f"step={BATCHES}.ckpt")
    assert gockpt.load_checkpoint(path, allow_pickle=True).captured_step == BATCHES  # not in epoch 2
    resumed = _state(*_run(tmp_path / "b", "plain", io=_io(mode), max_epochs=3, ckpt_path=path,
                           precision=precision))
    _same(resumed, ref)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", ["add_param_group", "unfreeze", "ema"])
def test_checkpoint_equals_stock_at_the_captured_step(tmp_path, mode, feature):
    """A param group added (or a parameter unfrozen) inside the copy windows is in the checkpoint.

    A checkpoint holding the added group cannot be resumed by this module (its optimizer gets the
    group at step 5 only, stock alike), so the checkpoint itself is compared with stock's.
    """
    _run(tmp_path / "g", feature, io=_io(mode), max_steps=8, ckpt_every_steps=4, callbacks=_callbacks(feature))
    ours = GoCkptIO().load_checkpoint(str(tmp_path / "g" / "step=4.ckpt"), weights_only=False)
    step = ours["global_step"]
    assert step == 4 + (0 if mode == "lazy" else 2)
    _run(tmp_path / "s", feature, max_steps=8, ckpt_every_steps=step, callbacks=_callbacks(feature))
    stock = torch.load(tmp_path / "s" / f"step={step}.ckpt", weights_only=False)
    for key in ("state_dict", "current_model_state"):
        if key in stock:
            assert_bitwise_equal(ours[key], stock[key], key)
    assert_bitwise_equal(ours["optimizer_states"][0]["state"], stock["optimizer_states"][0]["state"], "state")
    assert ours["optimizer_states"][0]["param_groups"] == stock["optimizer_states"][0]["param_groups"]
    assert ours["loops"] == stock["loops"]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("feature", ["clamp_late", "data_clamp_late", "data_before_update_late"])
def test_weights_first_edited_inside_a_saves_windows_are_checkpointed_as_stock(tmp_path, mode, feature):
    """The module starts editing its weights at step 5, while the save requested at step 4 is
    still copying: clamped in ``on_train_batch_end`` (in place, or through ``.data``), or scaled
    through ``.data`` in its ``on_before_optimizer_step`` (after GoCkpt's callback ended the
    window). That checkpoint holds its captured step bit for bit as stock's file of that step,
    and the later ones (copied at their request once an edit was seen) equal stock's files of
    the same name."""
    _run(tmp_path / "g", feature, io=_io(mode), max_steps=12, ckpt_every_steps=4)
    first = GoCkptIO().load_checkpoint(str(tmp_path / "g" / "step=4.ckpt"), weights_only=False)
    step = first["global_step"]
    assert step == 4 + (0 if mode == "lazy" else 2)
    _run(tmp_path / "s", feature, max_steps=12, ckpt_every_steps=2)
    for name, want in ((f"step={step}.ckpt", "step=4.ckpt"), ("step=8.ckpt", "step=8.ckpt"),
                       ("step=12.ckpt", "step=12.ckpt")):
        _same_as_stock(tmp_path / "g" / want, tmp_path / "s" / name)


@pytest.mark.parametrize("mode", MODES)
def test_an_edit_in_the_modules_batch_end_at_the_captured_step_loses_no_checkpoint(tmp_path, mode):
    """The module's on_train_batch_end (after every callback's) edits weights once, at the step
    a multi-step save is captured at: that checkpoint is written, equal to stock's file of its
    step, and so are the later ones."""
    _run(tmp_path / "g", "edit_at_capture", io=_io(mode), max_steps=12, ckpt_every_steps=4)
    assert sorted(p.name for p in (tmp_path / "g").glob("step=*.ckpt")) == \
        ["step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    step = GoCkptIO().load_checkpoint(str(tmp_path / "g" / "step=4.ckpt"), weights_only=False)["global_step"]
    assert step == 4 + (0 if mode == "lazy" else 2)
    _run(tmp_path / "s", "edit_at_capture", max_steps=12, ckpt_every_steps=2)
    for name, want in ((f"step={step}.ckpt", "step=4.ckpt"), ("step=8.ckpt", "step=8.ckpt"),
                       ("step=12.ckpt", "step=12.ckpt")):
        _same_as_stock(tmp_path / "g" / want, tmp_path / "s" / name)


@pytest.mark.parametrize("mode", MODES)
def test_run_stopped_by_max_steps_resumes_with_more_epochs(tmp_path, mode):
    """A save in flight when training ends carries the loop state of its captured step.

    (Step 12 is mid-epoch: the data must be resumable there, as for stock.)
    """
    ref = _state(*_run(tmp_path / "ref", "resumable", max_epochs=3))
    _run(tmp_path / "a", "resumable", io=_io(mode), max_steps=12, ckpt_every_steps=12)
    path = str(tmp_path / "a" / "step=12.ckpt")
    loaded = GoCkptIO().load_checkpoint(path)
    assert loaded["global_step"] == 12
    resumed = _state(*_run(tmp_path / "b", "resumable", io=_io(mode), max_epochs=3, ckpt_path=path))
    _same(resumed, ref)


def test_ema_checkpoint_holds_what_the_callback_wrote(tmp_path):
    """The averaged weights EMAWeightAveraging puts in ``state_dict`` are what is stored."""
    ema = EMAWeightAveraging(decay=0.9)
    trainer, model = _run(tmp_path / "a", "ema", io=_io("gockpt_o"), max_steps=7, ckpt_every_steps=4,
                          callbacks=(ema,))
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "a" / "step=4.ckpt"))
    assert set(loaded["current_model_state"]) == set(loaded["state_dict"])
    differs = [k for k in loaded["state_dict"]
               if not torch.equal(loaded["state_dict"][k], loaded["current_model_state"][k])]
    assert differs  # the average is not the live model




class _CrashAtEpoch(pl.Callback):
    def __init__(self, epoch: int) -> None:
        self.epoch = epoch

    def on_train_epoch_start(self, trainer, pl_module):
        if trainer.current_epoch == self.epoch:
            raise RuntimeError("crash")


def _spawned_crash(root, io) -> list[str]:
    pl.seed_everything(0, verbose=False)
    ckpt = ModelCheckpoint(dirpath=str(root), filename="{epoch}-{step}", save_top_k=1, every_n_epochs=1)
    trainer = pl.Trainer(default_root_dir=str(root), max_epochs=4, accelerator="cpu", devices=1,
                         strategy="ddp_spawn", logger=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[ckpt, _CrashAtEpoch(3)],
                         plugins=[io] if io else None, num_sanity_val_steps=0)
    with pytest.raises(Exception, match="crash"):
        trainer.fit(Net("plain"))
    return sorted(p.name for p in root.iterdir())


def test_crash_in_a_spawned_worker_keeps_top_k_as_stock(tmp_path):
    """An exception in a ``ddp_spawn`` worker runs no Lightning hook there: the save in flight
    and the top-k removal waiting for it are finished when the worker exits."""
    stock = _spawned_crash(tmp_path / "stock", None)
    ours = _spawned_crash(tmp_path / "ours", _io("gockpt"))
    assert ours == stock == [f"epoch=2-step={3 * BATCHES}.ckpt"]
    loaded = GoCkptIO().load_checkpoint(str(tmp_path / "ours" / ours[0]))
    want = torch.load(tmp_path / "stock" / stock[0], weights_only=False)
    assert_bitwise_equal(loaded["state_dict"], want["state_dict"], "state_dict")
    assert loaded["loops"] == want["loops"]


@pytest.mark.parametrize("mode", MODES)
def test_swa_run_ending_with_a_save_in_flight_resumes_as_stock(tmp_path, mode):
    """SWA moves the averaged weights into the model at ``on_train_end``; the epoch-end save of
    the last step is still in flight then, and must hold what stock wrote at the request.
    Stock SWA itself does not resume bit for bit against an uninterrupted run, so the resumed
    runs are compared with each other."""
    from lightning.pytorch.callbacks import StochasticWeightAveraging

    def swa():
        return (StochasticWeightAveraging(swa_lrs=0.01, swa_epoch_start=1, annealing_epochs=1),)

    _run(tmp_path / "s", "plain", max_epochs=2, every_epoch=True, callbacks=swa())
    _run(tmp_path / "g", "plain", io=_io(mode), max_epochs=2, every_epoch=True, callbacks=swa())
    name = f"step={2 * BATCHES}.ckpt"
    stock = torch.load(tmp_path / "s" / name, weights_only=False)
    ours = GoCkptIO().load_checkpoint(str(tmp_path / "g" / name), weights_only=False)
    assert_bitwise_equal(ours["state_dict"], stock["state_dict"], "state_dict")
    assert_bitwise_equal(ours["optimizer_states"][0]["state"], stock["optimizer_states"][0]["state"], "state")
    assert ours["loops"] == stock["loops"] and ours["global_step"] == stock["global_step"]
    resumed_stock = _state(*_run(tmp_path / "s2", "plain", max_epochs=4, callbacks=swa(),
                                 ckpt_path=str(tmp_path / "s" / name)))
    resumed_ours = _state(*_run(tmp_path / "g2", "plain", io=_io(mode), max_epochs=4, callbacks=swa(),
                                ckpt_path=str(tmp_path / "g" / name)))
    _same(resumed_ours, resumed_stock)


@pytest.mark.parametrize("mode", ["auto", *MODES])
@pytest.mark.parametrize("feature", ["clamp_after_batch", "clamp_in_step"])
def test_weights_edited_between_updates_are_checkpointed_as_stock(tmp_path, mode, feature):
    """A module that clamps its weights in place after each update (in ``on_train_batch_end``,
    which runs after ModelCheckpoint's save, or at the top of ``training_step``): every
    checkpoint is written, and each equals stock's file of the same name bit for bit."""
    io = GoCkptIO() if mode == "auto" else _io(mode)
    _run(tmp_path / "g", feature, io=io, max_steps=12, ckpt_every_steps=4)
    _run(tmp_path / "s", feature, max_steps=12, ckpt_every_steps=4)
    names = sorted(p.name for p in (tmp_path / "s").glob("*.ckpt"))
    assert names == ["step=12.ckpt", "step=4.ckpt", "step=8.ckpt"]
    assert sorted(p.name for p in (tmp_path / "g").glob("*.ckpt")) == names
    for name in names:
        _same_as_stock(tmp_path / "g" / name, tmp_path / "s" / name)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("end", ["should_stop", "skip_epoch", "raise"])
def test_a_loop_ending_before_a_saves_captured_step_checkpoints_the_last_batch_end_as_stock(
        tmp_path, mode, end):
    """The save requested at step 6 (5 for ``skip_epoch``) would be captured two updates later,
    but the loop ends before: a callback sets ``trainer.should_stop`` at step 7 (as a ``Timer``
    does), ``on_train_batch_start`` returns -1 after step 6 (the rest of the epoch is skipped),
    or the forward of step 8 raises. The checkpoint holds the last batch end, as stock's file of
    that step does (the loops' state too: it was taken after the loop had moved on), and a run
    resumed from it ends as one resumed from stock's file."""
    request, last = {"should_stop": (6, 7), "skip_epoch": (5, 6), "raise": (6, 7)}[end]
    feature = end if end != "should_stop" else "resumable"
    stop = (_StopAt(7),) if end == "should_stop" else ()

    def run(root, io, every, **kw):
        try:
            return _run(root, feature, io=io, max_epochs=2, ckpt_every_steps=every, callbacks=stop, **kw)
        except _Crash:
            return None

    run(tmp_path / "g", _io(mode), request)
    run(tmp_path / "s", None, 1)
    held = request if mode == "lazy" else last
    ours = tmp_path / "g" / f"step={request}.ckpt"
    assert GoCkptIO().load_checkpoint(str(ours))["global_step"] == held
    _same_as_stock(ours, tmp_path / "s" / f"step={held}.ckpt")
    if end == "raise":
        return  # a resumed run fails at the same step again
    feature = "resumable"  # resumed without the stop
    stop = ()
    resumed = _state(*run(tmp_path / "b", _io(mode), None, ckpt_path=str(ours)))
    stock = _state(*run(tmp_path / "c", None, None, ckpt_path=str(tmp_path / "s" / f"step={held}.ckpt")))
    _same(resumed, stock)


class _RaiseAt(pl.Callback):
    """Raises in step ``step``: at its batch end (after the update, before GoCkpt's step
    boundary, which comes right before the checkpoint callbacks), or in
    ``on_before_optimizer_step`` after writing a weight in place (before the update)."""

    def __init__(self, step: int, where: str) -> None:
        self.step, self.where = step, where

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.where == "before_update" and trainer.global_step + 1 == self.step:
            with torch.no_grad():
                pl_module.body[0].weight.add_(1.0)
            raise _Crash("stopped before the update")

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if self.where == "batch_end" and trainer.global_step == self.step:
            raise _Crash("stopped after the update")


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
@pytest.mark.parametrize("where", ["batch_end", "before_update"])
def test_an_exception_midway_through_a_step_leaves_no_torn_checkpoint(tmp_path, mode, where):
    """The save requested at step 6 is captured two updates later, but step 8 raises after its
    update and before the step boundary, or before its update after writing a weight: the
    live state there is no step's. That checkpoint is not written (stock's file of step 6,
    written at the request, has no counterpart); the one before it equals stock's."""
    with pytest.raises(_Crash):
        _run(tmp_path / "g", "resumable", io=_io(mode), max_epochs=2, ckpt_every_steps=3,
             callbacks=(_RaiseAt(8, where),))
    with pytest.raises(_Crash):
        _run(tmp_path / "s", "resumable", max_epochs=2, ckpt_every_steps=1, callbacks=(_RaiseAt(8, where),))
    assert not gockpt.is_complete(str(tmp_path / "g" / "step=6.ckpt"))
    ours = tmp_path / "g" / "step=3.ckpt"
    _same_as_stock(ours, tmp_path / "s" / f"step={GoCkptIO().load_checkpoint(str(ours))['global_step']}.ckpt")


@pytest.mark.parametrize("feature", ["resumable", "batch_norm"])
@pytest.mark.parametrize("mode", MODES)
def test_a_stop_inside_an_accumulation_checkpoints_the_steps_batch_end_as_stock(tmp_path, mode, feature):
    """Two batches per update: the run is stopped at the batch end after step 7's update, one
    batch into step 8's accumulation, while the save requested at step 6 is in flight. Stock's
    file of step 7 is taken at the batch end of its update; GoCkpt's holds that batch end's
    loops too (the weights are step 7's at both), and, with a batch norm, its running
    statistics before step 8's first forward moved them. A run resumed from it ends as one
    resumed from stock's file."""
    stop = (_StopAt(7, late=True),)
    _run(tmp_path / "g", feature, io=_io(mode), max_epochs=3, ckpt_every_steps=6,
         callbacks=stop, accumulate=2)
    _run(tmp_path / "s", feature, max_epochs=3, ckpt_every_steps=1, callbacks=stop, accumulate=2)
    ours = tmp_path / "g" / "step=6.ckpt"
    held = GoCkptIO().load_checkpoint(str(ours))["global_step"]
    assert held == (6 if mode == "lazy" else 7)
    _same_as_stock(ours, tmp_path / "s" / f"step={held}.ckpt")
    resumed = _state(*_run(tmp_path / "b", feature, io=_io(mode), max_epochs=3, accumulate=2,
                           ckpt_path=str(ours)))
    stock = _state(*_run(tmp_path / "c", feature, max_epochs=3, accumulate=2,
                         ckpt_path=str(tmp_path / "s" / f"step={held}.ckpt")))
    _same(resumed, stock)


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_forward_in_a_batch_end_callback_is_in_the_checkpoint_of_that_step_as_stock(tmp_path, mode):
    """A callback runs a train-mode forward at the batch end, before ModelCheckpoint saves: the
    batch norm's statistics of a step include it in stock's file. A save captured at that
    step is taken at the step's boundary, after that forward, not at the forward's start."""
    cbs = (_ForwardAtBatchEnd(),)
    _run(tmp_path / "g", "batch_end_forward", io=_io(mode), max_steps=8, ckpt_every_steps=3, callbacks=cbs)
    _run(tmp_path / "s", "batch_end_forward", max_steps=8, ckpt_every_steps=1, callbacks=cbs)
    for step in (3, 6):
        ours = tmp_path / "g" / f"step={step}.ckpt"
        held = GoCkptIO().load_checkpoint(str(ours))["global_step"]
        assert held > step
        _same_as_stock(ours, tmp_path / "s" / f"step={held}.ckpt")


@pytest.mark.parametrize("mode", ["gockpt", "gockpt_o"])
def test_a_save_from_the_modules_batch_end_captured_by_a_later_request_holds_one_step(tmp_path, mode):
    """The module's on_train_batch_end (after GoCkpt's batch end) saves at steps 2 and 5; a
    callback saving to one path every step requests at the next step's batch end, after its
    update and before GoCkpt's batch end of it, and so captures the earlier save there. That
    checkpoint holds one step: Lightning's dict (global_step, loops) of the step its tensors
    are, equal to stock's file of that step."""
    _run(tmp_path / "g", "module_save", io=_io(mode), max_steps=8, callbacks=(_SaveEvery(),))
    _run(tmp_path / "s", "module_save", max_steps=8, ckpt_every_steps=1)
    for step in (2, 5):
        ours = tmp_path / "g" / f"module-{step}.ckpt"
        held = GoCkptIO().load_checkpoint(str(ours))["global_step"]
        assert held == gockpt.load_checkpoint(str(ours), allow_pickle=True).captured_step
        assert held in (step, step + 1), held
        _same_as_stock(ours, tmp_path / "s" / f"step={held}.ckpt")


class _SaveBeforeOptimizerStep(pl.Callback):
    """Saves ``bopt-<step>.ckpt`` from ``on_before_optimizer_step`` at steps 2 and 5: after
    GoCkpt's own hook (the window end), right before the update."""

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if trainer.global_step in (2, 5):
            trainer.save_checkpoint(f"{trainer.default_root_dir}/bopt-{trainer.global_step}.ckpt")


@pytest.mark.parametrize("mode", ["auto", "lazy", "gockpt", "gockpt_o"])
@pytest.mark.parametrize("feature", ["plain", "batch_norm"])
def test_a_save_from_on_before_optimizer_step_is_written_and_training_goes_on(tmp_path, mode, feature):
    """A save requested after GoCkpt's window end and before the update (a callback's or the
    module's on_before_optimizer_step, gradient clipping) opens its copy window there: it ends
    before the update, as the save stock writes there, not as a torn copy that fails the run."""
    io = GoCkptIO() if mode == "auto" else _io(mode)
    _run(tmp_path / "g", feature, io=io, max_steps=8, callbacks=(_SaveBeforeOptimizerStep(),))
    _run(tmp_path / "s", feature, max_steps=8, callbacks=(_SaveBeforeOptimizerStep(),),
         ckpt_every_steps=1)
    for step in (2, 5):
        ours = tmp_path / "g" / f"bopt-{step}.ckpt"
        held = GoCkptIO().load_checkpoint(str(ours))["global_step"]
        if held == step:  # taken at the request, as stock's file
            _same_as_stock(ours, tmp_path / "s" / f"bopt-{step}.ckpt")
        else:  # a forced multi-step plan captures at a later step's batch end (README, Limits)
            assert mode in ("gockpt", "gockpt_o") and held > step, (mode, held)
            _same_as_stock(ours, tmp_path / "s" / f"step={held}.ckpt")
