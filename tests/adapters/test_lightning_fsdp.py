"""``GoCkptIO`` under Lightning's ``FSDPStrategy`` (``state_dict_type`` "full" and "sharded"), on one GPU (issue 13).

FSDP (version 1) needs an accelerator, so these tests run only where CUDA is present. The
scenario runs in a child process (this file as a script): Lightning initializes a NCCL process
group there, which must not leak into the other tests of a pytest worker.

1. The stock run (no GoCkpt) records, after every optimizer step, the dict stock FSDPStrategy
   would write (``dump_checkpoint``: the gathered weights and optimizer state).
2. The GoCkpt run, from the same seed, checkpoints every ``EVERY`` steps (``save_last=True``
   too: ``last.ckpt`` is saved over again and again) and stops at ``STOP``.
3. A fresh Trainer resumes from ``step=4.ckpt`` with ``fit(ckpt_path=...)`` to ``TOTAL``.

Checked: the checkpoint of step 4 equals stock's dict of step 4 bit for bit (a "sharded" one,
a DCP directory, is assembled with ``dcp_to_torch_save``); the resumed run ends bit-identical to
the uninterrupted stock run; the saves took GoCkpt's path (``async``, or ``lazy`` for the
sharded DCP directory: copied at the request, written in the background) and left no staging
directory.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="FSDPStrategy needs a CUDA device"),
]

EVERY = 4
STOP = 8
TOTAL = 12


def _child(root: str, sdt: str) -> None:  # noqa: PLR0915 - one scenario, read top to bottom
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import FSDPStrategy

    from lightning_gockpt import GoCkptIO

    sys.path.insert(0, os.path.dirname(__file__))
    from _lightning_train import _clone, assert_bitwise_equal
    from _one_gpu import Net, to_cpu

    torch.use_deterministic_algorithms(True)

    class Record(Callback):
        """Stock's checkpoint dict after every step (the strategy gathers it on rank 0)."""

        def __init__(self) -> None:
            self.dicts: dict[int, dict] = {}

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            ck = trainer._checkpoint_connector.dump_checkpoint()  # noqa: SLF001 - what stock saves
            self.dicts[trainer.global_step] = _clone({k: ck[k] for k in ("state_dict", "optimizer_states")})

    class Handles(Callback):
        """The engine's handles of the saves requested so far (read after step 5)."""

        def __init__(self, io: GoCkptIO) -> None:
            self.io, self.handles = io, []

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == EVERY + 1:
                cb = self.io._callback  # noqa: SLF001 - the test reads the engine's handles
                self.handles = list(cb._pending) + list(cb._finished)  # noqa: SLF001

    def trainer(path: str, max_steps: int, callbacks=(), io=None, state_dict_type: str = "full") -> pl.Trainer:
        return pl.Trainer(accelerator="cuda", devices=1, strategy=FSDPStrategy(state_dict_type=state_dict_type),
                          max_steps=max_steps,
                          default_root_dir=path, plugins=[io] if io is not None else None,
                          callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                          enable_model_summary=False,
                          enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))

    def weights(tr: pl.Trainer) -> dict:
        from lightning.fabric.strategies.fsdp import _get_full_state_dict_context

        with _get_full_state_dict_context(tr.strategy.model, world_size=1):
            return {k: v.detach().cpu().clone() for k, v in tr.strategy.model.state_dict().items()}

    def live(tr: pl.Trainer) -> dict:
        ck = tr._checkpoint_connector.dump_checkpoint()  # noqa: SLF001
        return _clone({k: ck[k] for k in ("state_dict", "optimizer_states")})

    pl.seed_everything(0, verbose=False)
    record = Record()
    ref = trainer(f"{root}/ref", TOTAL, [record])
    ref.fit(Net())

    pl.seed_everything(0, verbose=False)
    io = GoCkptIO(mode="lazy")
    probe = Handles(io)
    mc = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{step}", save_top_k=-1,
                         every_n_train_steps=EVERY, save_last=True)
    tr = trainer(f"{root}/a", STOP, [probe, mc], io, sdt)
    tr.fit(Net())
    assert type(tr.strategy).__name__ == "GoCkptFSDPStrategy"
    assert probe.handles, "no checkpoint was requested through GoCkpt"
    for h in probe.handles:
        assert h.result().mode == ("async" if sdt == "full" else "lazy")
    assert sorted(os.listdir(f"{root}/ckpt")) == ["last.ckpt", f"step={EVERY}.ckpt", f"step={STOP}.ckpt"]
    ck4 = f"{root}/ckpt/step={EVERY}.ckpt"
    want = {k: to_cpu(v) for k, v in record.dicts[EVERY].items()}
    if sdt == "full":
        assert os.path.isfile(os.path.join(ck4, "manifest.json"))  # a GoCkpt checkpoint directory
        got = io.load_checkpoint(ck4)
        assert got["global_step"] == EVERY
        assert_bitwise_equal({k: got[k] for k in ("state_dict", "optimizer_states")}, want, "step 4")
        last = io.load_checkpoint(f"{root}/ckpt/last.ckpt")
        assert last["global_step"] == STOP
        assert_bitwise_equal(last["state_dict"], to_cpu(record.dicts[STOP]["state_dict"]), "last")
    else:  # stock's DCP directory and meta.pt
        from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

        dcp_to_torch_save(ck4, f"{root}/step4.pt")
        got = torch.load(f"{root}/step4.pt", weights_only=False)
        assert_bitwise_equal(got["model"], want["state_dict"], "step 4 model")
        # Stock's full optimizer state of one rank is keyed by parameter index, DCP's by name.
        state, names = want["optimizer_states"][0]["state"], list(want["state_dict"])
        if all(isinstance(k, int) for k in state):
            state = {names[k]: v for k, v in state.items()}
        assert_bitwise_equal(got["optimizer_0"]["state"], state, "step 4 optim")
        assert torch.load(f"{ck4}/meta.pt", weights_only=False)["global_step"] == EVERY

    pl.seed_everything(0, verbose=False)
    resumed = trainer(f"{root}/b", TOTAL, [], GoCkptIO(mode="lazy"), sdt)
    resumed.fit(Net(), ckpt_path=ck4)
    assert resumed.global_step == TOTAL
    assert_bitwise_equal(weights(resumed), weights(ref), "resumed")
    if sdt == "full":
        assert_bitwise_equal(to_cpu(live(resumed)), to_cpu(live(ref)), "resumed")
    print("fsdp-ok", flush=True)


@pytest.mark.parametrize("state_dict_type", ["full", "sharded"])
def test_fsdp_checkpoint_equals_stock_and_resumes_exactly(tmp_path, state_dict_type):
    """FSDPStrategy with GoCkptIO on one GPU: the checkpoint equals stock's dict of its step bit
    for bit, and a resume from it ends bit-identical to the uninterrupted stock run."""
    from _one_gpu import run_child

    run_child(__file__, str(tmp_path), state_dict_type, ok="fsdp-ok")


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
