"""``GoCkptIO`` under Lightning DDP, 2 processes over gloo: the ranks share the write (issue 13).

Each test spawns its ranks once (``_dist.spawn``, from a fork server that has the imports
done; Lightning sees an external launcher through ``LOCAL_RANK``): they train the
uninterrupted stock DDP run (a stock ``.ckpt`` at every step), the GoCkpt run that checkpoints
mid-epoch, and then, with a new Trainer and a new model, resume from that checkpoint with
``fit(ckpt_path=...)``. Then this process resumes, with one device, from the GoCkpt checkpoint
and from the stock DDP ``.ckpt`` of the same step. The job is
``_lightning_train.TinyNet`` (dropout with its RNG state checkpointed, BatchNorm buffers,
AdamW, a per-step LR schedule, gradient clipping, a data position Lightning checkpoints).
"""

from __future__ import annotations

import json
import os
import shutil
import socket

import pytest
import torch
from _dist import end_rank, lightning_rank, spawn
from _lightning_train import assert_bitwise_equal, fit, results
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from test_lightning_fidelity import Net

import gockpt
from gockpt import cli, storage
from gockpt.dcp import load_full
from gockpt.sharded import part_name, sharding_name
from lightning_gockpt import GoCkptIO

TOTAL = 14  # optimizer steps of the uninterrupted run (10 batches per epoch and rank)
STOP = 10  # the GoCkpt run stops here
EVERY = 5  # ModelCheckpoint(every_n_train_steps=EVERY): step=5.ckpt is resumed
TOP = 4  # ModelCheckpoint(save_top_k=1, every_n_train_steps=TOP): no request inside step 5's windows
K = {"lazy": 1, "gockpt_o": 3}


class RankState(Callback):
    """A callback state that differs per rank: stock saves rank 0's, at the checkpoint's step."""

    def setup(self, trainer, pl_module, stage):
        self.trainer = trainer

    def state_dict(self):
        return {"rank": self.trainer.global_rank, "step": self.trainer.global_step}


class Probe(Callback):
    """Rank 0 of the GoCkpt run: the save returns before it is durable (gockpt_o), and no
    removal by ModelCheckpoint (``save_top_k=1`` removes the previous checkpoint right after
    requesting the next) ever leaves the newest complete checkpoint older than it was."""

    def __init__(self, root: str, mode: str) -> None:
        self.root, self.mode, self.seen, self.newest = root, mode, False, -1

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if not trainer.is_global_zero:
            return
        steps = [-1]
        for folder in (f"{self.root}/a", f"{self.root}/top"):
            for name in os.listdir(folder) if os.path.isdir(folder) else ():
                if name.startswith("."):
                    continue  # a save's staging directory, renamed away once published
                ckpt = f"{folder}/{name}"
                if storage.is_complete(ckpt):
                    fs = gockpt.fsutil.url_to_fs(ckpt, None)[0]
                    steps.append(storage.read_manifest(fs, ckpt)["meta"]["captured_step"])
        assert max(steps) >= self.newest, (self.newest, os.listdir(f"{self.root}/top"))
        self.newest = max(steps)

    def on_train_end(self, trainer, pl_module):
        # Once more after GoCkpt's callback (first in the list) has waited for every save: on a
        # slow disk none may have been durable at a batch start before the run stopped.
        self.on_train_batch_start(trainer, pl_module, None, 0)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        path = f"{self.root}/a/step={EVERY}.ckpt"
        if trainer.is_global_zero and trainer.global_step == EVERY + 1 and self.mode == "gockpt_o":
            assert not storage.is_complete(path), "the save blocked until durable"  # captured at 7
            assert os.path.isdir(path)  # rank 0's placeholder, for ModelCheckpoint's links
            self.seen = True


def _io(mode: str) -> GoCkptIO:
    return GoCkptIO(mode=mode, min_overlap_steps=K[mode], max_overlap_steps=K[mode])


def _worker(rank: int, port: int, root: str, mode: str) -> None:
    lightning_rank(rank, port)
    ddp = {"strategy": "ddp", "devices": 2}
    # Stock DDP, uninterrupted, a .ckpt at every step (rank 0 writes them).
    trainer, model = fit(f"{root}/ref", max_steps=TOTAL, ckpt_every=1, callbacks=(RankState(),), **ddp)
    if rank == 0:
        torch.save(results(trainer, model), f"{root}/ref.pt")
    probe = Probe(root, mode)
    top = ModelCheckpoint(dirpath=f"{root}/top", filename="top-{step}", save_top_k=1, every_n_train_steps=TOP)
    trainer, _ = fit(f"{root}/a", io=_io(mode), max_steps=STOP, ckpt_every=EVERY, save_last="link",
                     callbacks=(RankState(), probe, top), **ddp)
    assert probe.seen == (mode == "gockpt_o" and rank == 0)
    assert rank != 0 or probe.newest >= EVERY
    assert type(trainer.strategy).__name__ == "GoCkptDDPStrategy"
    # A new Trainer and model resume from the mid-epoch checkpoint (fit returned once committed).
    trainer, model = fit(f"{root}/b", io=_io(mode), max_steps=TOTAL,
                         ckpt_path=f"{root}/a/step={EVERY}.ckpt", **ddp)
    if rank == 0:
        torch.save(results(trainer, model), f"{root}/resumed.pt")
    end_rank()


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _assert_shared(path: str, captured: int) -> None:
    """Both ranks wrote a part holding tensor bytes; together each tensor once."""
    fqns, sizes = [], []
    for r in range(2):
        part = os.path.join(path, part_name(r))
        manifest = storage.read_manifest(gockpt.fsutil.url_to_fs(part, None)[0], part)
        assert manifest["meta"]["captured_step"] == captured
        sharding = json.load(open(os.path.join(path, sharding_name(r))))
        assert set(manifest["tensors"]) == set(sharding["tensors"])
        fqns.append({i["fqn"] for i in sharding["tensors"].values()})
        sizes.append(sum(e["bytes"] for name, e in manifest["files"].items() if name.endswith(".safetensors")))
    assert all(s > 0 for s in sizes), sizes
    assert fqns[0].isdisjoint(fqns[1])
    full = load_full(path)
    want = {f"model.{k}" for k in full.model_state_dict}
    want |= {f"optim.state.{p}.{n}" for p, st in full.optimizer_state.items() for n in st}
    assert fqns[0] | fqns[1] == want
    assert any(k.startswith("optim.state.") for k in fqns[1]), "rank 1 stored no optimizer state"


@pytest.mark.parametrize("mode", list(K))
def test_ddp_ranks_share_the_write_and_resume_exactly(tmp_path, mode):
    """2-rank DDP with GoCkptIO: the checkpoint requested at step 5 (captured at 5 in lazy, at 7
    in gockpt_o with K=3) is written in parts by both ranks; a new 2-process run resumed from
    it ends bit-identical to the uninterrupted stock DDP run; one device resumed from it ends
    bit-identical to one device resumed from the stock DDP .ckpt of the captured step, and loads
    the same dict; ModelCheckpoint(save_top_k=1) leaves only the newest, committed; save_last
    links to the last one."""
    root = str(tmp_path)
    captured = EVERY + K[mode] - 1
    spawn(_worker, args=(_port(), root, mode), nprocs=2)
    path = f"{root}/a/step={EVERY}.ckpt"
    _assert_shared(path, captured)
    assert set(os.listdir(f"{root}/a")) == {f"step={EVERY}.ckpt", f"step={STOP}.ckpt", "last.ckpt"}
    assert os.readlink(f"{root}/a/last.ckpt") == f"step={STOP}.ckpt"  # save_last="link"
    assert GoCkptIO().load_checkpoint(f"{root}/a/last.ckpt")["global_step"] == STOP
    last_top = STOP // TOP * TOP  # requested at 8, captured at 10 in gockpt_o (max_steps)
    assert os.listdir(f"{root}/top") == [f"top-step={last_top}.ckpt"]
    assert load_full(f"{root}/top/top-step={last_top}.ckpt").captured_step == min(last_top + K[mode] - 1, STOP)

    # The dict GoCkptIO loads is the one stock DDP saved at the captured step.
    ours = GoCkptIO().load_checkpoint(path)
    stock = torch.load(f"{root}/ref/step={captured}.ckpt", weights_only=False)
    assert list(ours["state_dict"]) == list(stock["state_dict"])  # stock's key order
    assert ours["state_dict"]._metadata == stock["state_dict"]._metadata
    for key in ("state_dict", "optimizer_states", "lr_schedulers", "loops", "rng_state", "global_step",
                "epoch", "hyper_parameters"):
        assert_bitwise_equal(ours[key], stock[key], key)
    assert list(ours["optimizer_states"][0]["state"]) == list(stock["optimizer_states"][0]["state"])
    state_key = RankState().state_key
    assert ours["callbacks"][state_key] == stock["callbacks"][state_key] == {"rank": 0, "step": captured}
    assert list(ours)[:4] == list(stock)[:4]  # stock's order of Lightning's entries
    # The command line reads the shared layout: verify checks every part, convert joins them.
    assert cli.main(["verify", path]) == 0
    assert cli.main(["convert", path, f"{root}/one.ckpt", "--to", "lightning"]) == 0
    assert_bitwise_equal(torch.load(f"{root}/one.ckpt", weights_only=False), ours, "converted")
    shutil.copytree(path, f"{root}/bad.ckpt")
    shard = next(p for p in os.listdir(f"{root}/bad.ckpt/rank-00001") if p.endswith(".safetensors"))
    with open(f"{root}/bad.ckpt/rank-00001/{shard}", "r+b") as f:
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 1]))  # one bit of rank 1's last tensor
    assert cli.main(["verify", f"{root}/bad.ckpt"]) == 1

    ref, resumed = torch.load(f"{root}/ref.pt"), torch.load(f"{root}/resumed.pt")
    assert resumed["global_step"] == TOTAL
    assert sorted(resumed["losses"]) == list(range(captured, TOTAL))
    assert all(resumed["losses"][b] == ref["losses"][b] for b in resumed["losses"])
    assert_bitwise_equal(resumed["model"], ref["model"], "model")
    assert_bitwise_equal(resumed["optim"], ref["optim"], "optim")

    # One device, no DDP: the same checkpoint continues as stock continues from its own.
    one = results(*fit(f"{root}/one", io=_io(mode), max_steps=TOTAL, ckpt_path=path))
    one_stock = results(*fit(f"{root}/one-stock", max_steps=TOTAL, ckpt_path=f"{root}/ref/step={captured}.ckpt"))
    assert one["global_step"] == one_stock["global_step"] == TOTAL
    assert_bitwise_equal(one, one_stock, "one device")


def test_ddp_spawn_shares_the_write(tmp_path, monkeypatch):
    """``strategy="ddp_spawn"`` (2 processes spawned by Lightning) goes through the same hooks:
    both ranks write a part; the last checkpoint loads as the weights the run ended with (rank
    0's, returned to this process by Lightning), and the mid-epoch one holds the captured step."""
    monkeypatch.setenv("MASTER_PORT", str(_port()))  # Lightning's launcher takes it from here
    trainer, model = fit(str(tmp_path), io=_io("gockpt_o"), max_steps=STOP, ckpt_every=EVERY,
                         strategy="ddp_spawn", devices=2)
    captured = EVERY + K["gockpt_o"] - 1
    _assert_shared(str(tmp_path / f"step={EVERY}.ckpt"), captured)
    _assert_shared(str(tmp_path / f"step={STOP}.ckpt"), STOP)
    mid = GoCkptIO().load_checkpoint(str(tmp_path / f"step={EVERY}.ckpt"))
    assert mid["global_step"] == captured
    assert mid["loops"]["fit_loop"]["epoch_loop.batch_progress"]["total"]["processed"] == captured
    last = GoCkptIO().load_checkpoint(str(tmp_path / f"step={STOP}.ckpt"))
    assert last["global_step"] == STOP
    assert_bitwise_equal(last["state_dict"], {k: v.detach() for k, v in model.state_dict().items()}, "weights")


def _last_worker(rank: int, port: int, root: str, mode: str) -> None:
    lightning_rank(rank, port)
    io = GoCkptIO() if mode == "auto" else _io(mode)
    fit(root, io=io, max_steps=4, ckpt_every=1, save_top_k=1, save_last=True, strategy="ddp", devices=2)
    end_rank()


@pytest.mark.parametrize("mode", ["auto", "gockpt_o"])
def test_ddp_saves_last_ckpt_over_itself_at_every_step(tmp_path, mode):
    """``save_last=True`` under DDP: each save of ``last.ckpt`` replaces the one before, whose
    folder holds both ranks' parts and markers (a GoCkpt checkpoint, not someone's folder)."""
    spawn(_last_worker, args=(_port(), str(tmp_path), mode), nprocs=2)
    assert sorted(os.listdir(tmp_path)) == ["last.ckpt", "step=4.ckpt"]
    last = GoCkptIO().load_checkpoint(str(tmp_path / "last.ckpt"))
    assert last["global_step"] == 4


def test_ddp_optimizers_sharing_a_parameter_checkpoint_as_stock(mid_run_changes):
    """Two optimizers over the same parameters under DDP: no unit layout to share out, so rank
    0 takes each checkpoint whole at its request; it equals stock DDP's bit for bit."""
    root = mid_run_changes
    ours = GoCkptIO().load_checkpoint(f"{root}/shared/g/step=4.ckpt", weights_only=False)
    stock = torch.load(f"{root}/shared/s/step=4.ckpt", weights_only=False)
    assert ours["global_step"] == stock["global_step"] == 4
    assert_bitwise_equal(ours["state_dict"], stock["state_dict"], "state_dict")
    assert_bitwise_equal(ours["optimizer_states"], stock["optimizer_states"], "optimizer_states")


def test_ddp_state_the_shards_cannot_hold_is_saved_as_stock_saves_it(mid_run_changes):
    """A complex parameter (AdamW state complex too) and a complex buffer under DDP with the
    ranks sharing the write: no shard holds them, so they are stored whole in the pickled part
    (once, by rank 0); a checkpoint held at a later step (K = 3) equals stock DDP's file of
    that step bit for bit."""
    root = mid_run_changes
    ours = GoCkptIO().load_checkpoint(f"{root}/complex/g/step=4.ckpt", weights_only=False)
    assert ours["global_step"] > 4  # held at a later step: the capture there is what is tested
    stock = torch.load(f"{root}/complex/s/step={ours['global_step']}.ckpt", weights_only=False)
    assert ours["state_dict"]["rot"].dtype == torch.complex64
    for key in ("state_dict", "optimizer_states"):
        assert_bitwise_equal(ours[key], stock[key], key)


class _SwapNet(Net):
    """test_lightning_fidelity's Net (BatchNorm, data resumable mid-epoch), its optimizers
    replaced by SGD at the batch start of step ``swap``."""

    def __init__(self, swap: int) -> None:
        super().__init__("batch_norm")
        self.swap = swap

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == self.swap and not isinstance(self.trainer.optimizers[0], torch.optim.SGD):
            self.trainer.optimizers = [torch.optim.SGD(self.parameters(), lr=0.01, momentum=0.9)]


class _SwapToSharedNet(Net):
    """Manual optimization, one AdamW until the batch start of step ``swap``, then two SGDs
    over the same parameters, each stepping every batch."""

    def __init__(self, swap: int) -> None:
        super().__init__("manual")
        self.swap = swap

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == self.swap and len(self.trainer.optimizers) == 1:
            self.trainer.optimizers = [torch.optim.SGD(self.parameters(), lr=0.01),
                                       torch.optim.SGD(self.parameters(), lr=0.02, momentum=0.9)]
            # A save before the callback's batch end saw the replacement: ranks other than 0
            # stop writing inside it (they raised, and rank 0 waited for them in a barrier).
            self.trainer.save_checkpoint(f"{self.trainer.default_root_dir}/after-swap.ckpt")

    def training_step(self, batch, batch_idx):
        x, t = batch
        opts = self.optimizers()
        for opt in opts if isinstance(opts, list) else [opts]:
            opt.zero_grad()
            self.manual_backward((self(x) - t).pow(2).mean())
            opt.step()


class _MidSave(Callback):
    """``trainer.save_checkpoint`` at the ends of batches 1 and 2 of the first epoch: with
    ``accumulate_grad_batches=2`` the second is inside an accumulation, at the same optimizer
    step as the first, after a forward that moved the batch-norm statistics."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.current_epoch == 0 and batch_idx in (1, 2):
            trainer.save_checkpoint(f"{trainer.default_root_dir}/mid-b{batch_idx}.ckpt")


class _RankDataNet(Net):
    """test_lightning_fidelity's Net with data of each rank's own (DDP's sampler does not split
    an iterable), so that the ranks' copies of a layer DDP does not average drift apart."""

    def train_dataloader(self):
        from test_lightning_fidelity import BATCHES, _Resumable

        g = torch.Generator().manual_seed(7 + self.global_rank)
        return _Resumable(torch.randn(BATCHES * 4, 8, generator=g))


class _RankLrNet(Net):
    """Rank 1 alone halves its learning rate at the batch start of step 5 (a schedule stepped on
    a metric of its own): from that update on, the ranks' copies differ."""

    def __init__(self) -> None:
        super().__init__("batch_norm")

    def on_train_batch_start(self, batch, batch_idx):
        if self.trainer.global_step == 5 and self.global_rank == 1:
            for g in self.trainer.optimizers[0].param_groups:
                g["lr"] = g["lr"] / 2


class _UnfreezeSwapNet(_RankDataNet):
    """As _RankDataNet("unfreeze"), and the optimizers replaced when the layer is unfrozen (at
    the batch start of step 5): the engines are rebuilt then, with the layer requiring grads."""

    def __init__(self) -> None:
        super().__init__("unfreeze")

    def on_train_batch_start(self, batch, batch_idx):
        frozen = not self.extra.weight.requires_grad
        super().on_train_batch_start(batch, batch_idx)
        if frozen and self.extra.weight.requires_grad:
            self.trainer.optimizers = [torch.optim.AdamW(self.parameters(), lr=0.05, weight_decay=0.01)]


#: Runs under 2-rank DDP (test_ddp_mid_run_*, and two whose state the ranks cannot share
#: out): module, max_steps, GoCkpt's every_n_train_steps, extra Trainer arguments. Stock saves
#: at every step.
_CHANGES = {
    "shared": (lambda: Net("shared"), 8, 4, {}),
    "complex": (lambda: Net("complex"), 8, 4, {}),
    "swap": (lambda: _SwapNet(6), 14, 5, {}),
    "swap_to_shared": (lambda: _SwapToSharedNet(3), 11, 1, {}),
    "accumulation": (lambda: Net("batch_norm"), 8, 3, {"accumulate_grad_batches": 2, "callbacks": [_MidSave()]}),
    "replicas_differ": (lambda: _RankDataNet("unfreeze"), 12, 3, {}),
    "replicas_differ_in_window": (_RankLrNet, 10, 4, {}),
    "replicas_differ_after_rebuild": (_UnfreezeSwapNet, 12, 3, {}),
}


def _changes_worker(rank: int, port: int, root: str) -> None:
    import lightning.pytorch as pl

    lightning_rank(rank, port)
    for case, (module, max_steps, every, extra) in _CHANGES.items():
        for run, io, each in (("g", _io("gockpt_o"), every), ("s", None, 1)):
            d = f"{root}/{case}/{run}"
            kwargs = dict(extra)
            callbacks = [*kwargs.pop("callbacks", []),
                         ModelCheckpoint(dirpath=d, filename="{step}", save_top_k=-1, every_n_train_steps=each)]
            pl.seed_everything(0, verbose=False)
            pl.Trainer(default_root_dir=d, max_steps=max_steps, accelerator="cpu", devices=2, strategy="ddp",
                       logger=False, enable_progress_bar=False, enable_model_summary=False,
                       callbacks=callbacks, plugins=[io] if io is not None else None, **kwargs).fit(module())
    end_rank()


@pytest.fixture(scope="module")
def mid_run_changes(tmp_path_factory) -> str:
    """The runs of :data:`_CHANGES` under 2-rank DDP with the ranks sharing the write, GoCkptIO
    (gockpt_o, K=3) and stock, in one spawn (each spawn costs seconds of imports)."""
    root = str(tmp_path_factory.mktemp("changes"))
    spawn(_changes_worker, args=(_port(), root), nprocs=2)
    return root


def _equal_to_stock(root: str, case: str, keys=("state_dict", "optimizer_states", "lr_schedulers"),
                    same_name: tuple[str, ...] = ()) -> list[int]:
    """Check that each GoCkpt checkpoint of ``case`` equals stock's file of the step it holds
    (``same_name``: stock's file of that name) and records that step in every manifest; returns
    those steps, in the order of the names."""
    held = []
    for name in _ckpt_names(f"{root}/{case}/g"):
        path = f"{root}/{case}/g/{name}"
        ours = GoCkptIO().load_checkpoint(path, weights_only=False)
        held.append(ours["global_step"])
        parts = [os.path.join(path, part_name(r)) for r in range(2)] if os.path.isdir(
            os.path.join(path, part_name(0))) else [path]
        for part in parts:
            meta = storage.read_manifest(gockpt.fsutil.url_to_fs(part, None)[0], part)["meta"]
            assert meta["captured_step"] == ours["global_step"], (case, name, part)
        want = name if name in same_name else f"step={ours['global_step']}.ckpt"
        stock = torch.load(f"{root}/{case}/s/{want}", weights_only=False)
        for key in keys:
            assert_bitwise_equal(ours[key], stock[key], f"{case}/{name}.{key}")
    return held


def _ckpt_names(folder: str) -> list[str]:
    def order(n: str) -> tuple:
        return (0, int(n[5:-5])) if n.startswith("step=") else (-1, n)
    return sorted((n for n in os.listdir(folder) if n.endswith(".ckpt")), key=order)


def test_ddp_mid_run_optimizers_replaced_are_followed(mid_run_changes):
    """``trainer.optimizers = [SGD(...)]`` at the batch start of step 6, with the ranks sharing
    the write: the engines of both ranks are rebuilt over the new optimizer, so each checkpoint
    holds one step, recorded as Lightning's (the manifests' steps froze at the swap), and equals
    stock DDP's file of that step. The save requested at step 5 (K = 3, captured at 7) is not
    written, never torn: the new optimizer's update went past its step before it was captured.
    The one requested at step 10 is captured at 12 by the rebuilt engines."""
    assert _ckpt_names(f"{mid_run_changes}/swap/g") == ["step=10.ckpt"]
    assert _equal_to_stock(mid_run_changes, "swap") == [12]


def test_ddp_mid_run_optimizers_replaced_by_ones_sharing_a_parameter(mid_run_changes):
    """The optimizers are replaced at step 3 by two that update the same parameters: no share
    of units fits them, so rank 0 writes from then on, as in a run that starts with them (a
    save right after the replacement included). Every checkpoint records the step it holds
    (they froze at the replacement) and equals stock DDP's file of that step."""
    root = mid_run_changes
    want = ["after-swap.ckpt", *(f"step={s}.ckpt" for s in (1, 2, 3, 5, 7, 9, 11))]
    assert _ckpt_names(f"{root}/swap_to_shared/g") == want
    assert _equal_to_stock(root, "swap_to_shared", ("state_dict", "optimizer_states"),
                           same_name=("after-swap.ckpt",)) == [3, 1, 2, 3, 5, 7, 9, 11]


def test_ddp_mid_run_saves_inside_a_gradient_accumulation_hold_one_step_on_every_rank(mid_run_changes):
    """``accumulate_grad_batches=2``, a second save requested at the step of one in flight after
    the state moved (batch-norm statistics, which only rank 0's part holds): rank 0 finished the
    first save at once while rank 1 kept it to its planned step, so the parts disagreed and it
    was not committed (and a longer run failed at its end). Every rank now decides alike: each
    file is written and equals stock DDP's file of the step it holds."""
    assert _ckpt_names(f"{mid_run_changes}/accumulation/g") == [
        "mid-b1.ckpt", "mid-b2.ckpt", "step=3.ckpt", "step=6.ckpt"]
    _equal_to_stock(mid_run_changes, "accumulation", ("state_dict", "optimizer_states", "lr_schedulers", "loops"))


def test_ddp_mid_run_replicas_that_differ_are_written_from_rank_0(mid_run_changes):
    """A layer frozen when DDP wrapped the model is unfrozen at step 5 (what BackboneFinetuning
    does): DDP never averages its gradients, so each rank trains its own copy of it. The ranks
    sharing the write stored each one's share from its own copy, a state no rank had; now a
    save finds the replicas may differ and rank 0 writes from then on, as stock DDP does. Every
    checkpoint equals stock DDP's file of the step it holds."""
    root = f"{mid_run_changes}/replicas_differ/g"
    assert _ckpt_names(root) == ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt", "step=12.ckpt"]
    held = _equal_to_stock(mid_run_changes, "replicas_differ", ("state_dict", "optimizer_states"))
    assert held[0] == 5  # a multi-step save of the shares, before the unfreeze
    assert os.path.isdir(f"{root}/step=3.ckpt/{part_name(1)}")
    assert not os.path.isdir(f"{root}/step=9.ckpt/{part_name(1)}")  # rank 0's whole file


def test_ddp_mid_run_replicas_that_differ_inside_the_copy_windows_are_not_committed(mid_run_changes):
    """Rank 1 alone changes its learning rate at step 5, inside the copy windows of the save
    requested at step 4 (K = 3, captured at 6): each part recorded its rank's copy at 6, rank
    1's share trained at another rate, a state no rank had. The commit now finds the replicas
    differed at the captured step and does not commit it (a warning); the next save finds them
    differing at its request, and rank 0 writes it, equal to stock DDP's file."""
    root = f"{mid_run_changes}/replicas_differ_in_window/g"
    assert _ckpt_names(root) == ["step=8.ckpt"]
    _equal_to_stock(mid_run_changes, "replicas_differ_in_window", ("state_dict", "optimizer_states"))
    assert not os.path.isdir(f"{root}/step=8.ckpt/{part_name(1)}")


def test_ddp_mid_run_replicas_that_differ_are_told_after_an_engine_rebuild(mid_run_changes):
    """The layer is unfrozen and the optimizers replaced at once: the engines are rebuilt with
    the layer requiring gradients, yet DDP still does not average them. The parameters DDP
    averages are those of when it wrapped the model, not of the rebuild: rank 0 writes from
    then on, each checkpoint equal to stock DDP's file of its step."""
    root = f"{mid_run_changes}/replicas_differ_after_rebuild/g"
    assert _ckpt_names(root) == ["step=3.ckpt", "step=6.ckpt", "step=9.ckpt", "step=12.ckpt"]
    _equal_to_stock(mid_run_changes, "replicas_differ_after_rebuild", ("state_dict", "optimizer_states"))
    assert not os.path.isdir(f"{root}/step=6.ckpt/{part_name(1)}")


def _weights_only_worker(rank: int, port: int, root: str) -> None:
    lightning_rank(rank, port)
    ddp, only = {"strategy": "ddp", "devices": 2}, {"save_weights_only": True}
    # Stock DDP, a weights-only .ckpt at every step (rank 0 writes them).
    fit(f"{root}/ref", max_steps=STOP, ckpt_every=1, checkpoint_kwargs=only, **ddp)
    fit(f"{root}/a", io=_io("gockpt_o"), max_steps=STOP, ckpt_every=EVERY, checkpoint_kwargs=only, **ddp)
    end_rank()


@pytest.fixture(scope="module")
def weights_only_run(tmp_path_factory) -> str:
    """Stock DDP and GoCkptIO DDP (gockpt_o, K=3), both ``ModelCheckpoint(save_weights_only=True)``."""
    root = str(tmp_path_factory.mktemp("weights_only"))
    spawn(_weights_only_worker, args=(_port(), root), nprocs=2)
    return root


def test_ddp_weights_only_loads_the_stock_dict(weights_only_run):
    """``save_weights_only=True`` with the ranks sharing the write: both ranks store a part, and
    the dict GoCkptIO loads is stock DDP's weights-only ``.ckpt`` of the captured step, bit for
    bit, in its key order: no ``optimizer_states``, ``lr_schedulers`` or callback state."""
    root = weights_only_run
    for requested, captured in ((EVERY, EVERY + K["gockpt_o"] - 1), (STOP, STOP)):
        path = f"{root}/a/step={requested}.ckpt"
        assert cli.main(["verify", path]) == 0
        ours = GoCkptIO().load_checkpoint(path)
        stock = torch.load(f"{root}/ref/step={captured}.ckpt", weights_only=False)
        assert "optimizer_states" not in stock and "optimizer_states" not in ours
        assert list(ours) == list(stock)
        assert list(ours["state_dict"]) == list(stock["state_dict"])
        assert ours["state_dict"]._metadata == stock["state_dict"]._metadata
        assert_bitwise_equal(ours, stock, f"step={requested}.ckpt")
        stored = [set(_part_tensors(path, r)) for r in range(2)]
        assert all(stored) and stored[0].isdisjoint(stored[1]), stored  # both ranks wrote, once each
        assert {f"model.{k}" for k in stock["state_dict"]} <= stored[0] | stored[1]


def test_ddp_weights_only_parts_hold_no_optimizer_state(weights_only_run):
    """Like stock's weights-only ``.ckpt``, no part of a weights-only DDP checkpoint holds
    optimizer state: no optimizer tensor in any part's files or sharding, none in its tree."""
    from gockpt.dcp import load_parts

    for requested in (EVERY, STOP):
        path = f"{weights_only_run}/a/step={requested}.ckpt"
        for r in range(2):
            assert not [k for k in _part_tensors(path, r) if not k.startswith("model.")], (path, r)
            sharding = json.load(open(os.path.join(path, sharding_name(r))))
            assert not [t["fqn"] for t in sharding["tensors"].values() if t["fqn"].startswith("optim.")]
        _, parts = load_parts(path)
        assert all("optimizer_states" not in p.extra["lightning"] for p in parts)


def _part_tensors(path: str, rank: int) -> list[str]:
    """The layout keys of the tensors rank ``rank``'s part of ``path`` stores in its files."""
    part = os.path.join(path, part_name(rank))
    return list(storage.read_manifest(gockpt.fsutil.url_to_fs(part, None)[0], part)["tensors"])


def _lightning_dict() -> tuple[dict, torch.nn.Module, torch.optim.Optimizer]:
    """A stock-shaped Lightning dict of a small stepped model (BatchNorm buffers, AdamW)."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 32),
                                torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.randn(4, 8)).sum().backward()
    opt.step()
    sd = model.state_dict()
    sd["2.weight"] = sd["2.weight"] * 2  # a hook's edit: not the live tensor
    ck = {"epoch": 0, "global_step": 1, "state_dict": sd, "loops": {"x": torch.tensor([3])},
          "optimizer_states": [opt.state_dict()], "lr_schedulers": []}
    return ck, model, opt


def test_parts_join_into_the_stock_dict_and_refuse_a_bad_split():
    """Each rank's part keeps its share of ``state_dict``/``optimizer_states`` (rank 0 also the
    buffers and the rest of the dict); joined, they are the dict, in its order; a key stored by
    two parts or by none is a corrupt checkpoint."""
    from gockpt.layout import build_layout
    from gockpt.partition import partition_layout
    from lightning_gockpt import replicated

    ck, model, opt = _lightning_dict()
    layout = build_layout(model, [opt])
    parts = [partition_layout(layout, r, 2).partition for r in range(2)]
    trees = [replicated.part_state(ck, parts[r], r) for r in range(2)]
    assert set(trees[1]["lightning"]) == {"state_dict", "optimizer_states"}
    assert list(trees[0]["lightning"]) == list(ck)  # rank 0: the whole dict, in its order
    shares = [set(t["lightning"]["state_dict"]) for t in trees]
    assert shares[0].isdisjoint(shares[1]) and shares[0] | shares[1] == set(ck["state_dict"])
    assert shares[1] and {"1.running_mean", "1.num_batches_tracked"} <= shares[0]
    states = [set(t["lightning"]["optimizer_states"][0]["state"]) for t in trees]
    assert states[0].isdisjoint(states[1]) and states[0] | states[1] == set(ck["optimizer_states"][0]["state"])
    joined = replicated.join(trees)
    assert list(joined) == list(ck) and list(joined["state_dict"]) == list(ck["state_dict"])
    assert joined["state_dict"]._metadata == ck["state_dict"]._metadata
    assert list(joined["optimizer_states"][0]["state"]) == list(ck["optimizer_states"][0]["state"])
    assert_bitwise_equal(joined, ck, "joined")
    twice = [trees[0], {"lightning": {**trees[1]["lightning"], "state_dict": ck["state_dict"]}}]
    with pytest.raises(gockpt.CheckpointCorruptError, match="stored by two parts"):
        replicated.join(twice, "ck")
    with pytest.raises(gockpt.CheckpointCorruptError, match="unlike the order"):
        replicated.join([trees[0], {"lightning": {**trees[1]["lightning"], "state_dict": {}}}], "ck")
    with pytest.raises(gockpt.CheckpointCorruptError, match="no Lightning state"):
        replicated.join([trees[0], None], "ck")


def test_ddp_keeps_one_writer_for_an_object_store_or_a_zero_optimizer(tmp_path):
    """Sharded checkpoints are local: a ModelCheckpoint on an object store, or an optimizer
    whose state is not replicated (ZeRO), keeps rank 0's write (decided once, at train start)."""
    from types import SimpleNamespace

    from torch.distributed.optim import ZeroRedundancyOptimizer

    from lightning_gockpt.sharded import shares_write

    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)

    def trainer(dirpath, optimizer=opt, num_nodes=1):
        return SimpleNamespace(optimizers=[optimizer], num_nodes=num_nodes,
                               checkpoint_callbacks=[ModelCheckpoint(dirpath=dirpath)])

    assert shares_write(trainer(str(tmp_path)), None)
    assert shares_write(trainer(f"file://{tmp_path}"), None)
    assert not shares_write(trainer("memory://run/ckpts"), None)
    assert not shares_write(trainer("s3://bucket/ckpts"), {"anon": True})
    zero = object.__new__(ZeroRedundancyOptimizer)  # its type is what tells: no process group needed
    assert not shares_write(trainer(str(tmp_path), zero), None)
    # Several nodes: their local disks may differ, so rank 0 writes alone.
    assert not shares_write(trainer(str(tmp_path), num_nodes=2), None)
    # Two optimizers over one parameter: no unit layout to split, rank 0 takes it whole.
    second = torch.optim.AdamW(opt.param_groups[0]["params"], lr=0.1)
    both = SimpleNamespace(optimizers=[opt, second], num_nodes=1,
                           checkpoint_callbacks=[ModelCheckpoint(dirpath=str(tmp_path))])
    assert not shares_write(both, None)
