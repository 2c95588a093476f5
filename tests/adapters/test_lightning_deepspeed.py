"""``GoCkptIO`` under Lightning's ``DeepSpeedStrategy`` (ZeRO stage 2), on one GPU (issue 13).

DeepSpeed needs an accelerator and the deepspeed package, so these tests run only where both
are present. The scenario runs in a child process (this file as a script): Lightning
initializes a NCCL process group there, which must not leak into the other tests.

1. The stock run (no GoCkpt) saves DeepSpeed's own checkpoint at step ``EVERY`` and trains on
   to ``TOTAL``.
2. The GoCkpt run, from the same seed, checkpoints every ``EVERY`` steps (``save_last=True``
   too: ``last.ckpt`` is saved over again and again) and stops at ``STOP``.
3. A fresh Trainer resumes from ``step=4.ckpt`` with ``fit(ckpt_path=...)`` to ``TOTAL``.

Checked: every file of the GoCkpt checkpoint of step 4 loads equal, bit for bit, to the same
file of stock's checkpoint of step 4 (the module, the ZeRO partitions, the optimizer state,
Lightning's loop state); no staging directory is left; the resumed run ends bit-identical to
the uninterrupted stock run.
"""

from __future__ import annotations

import importlib.util
import os
import sys

import pytest
import torch

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="DeepSpeedStrategy needs a CUDA device"),
]

EVERY = 4
STOP = 8
TOTAL = 12


def _child(root: str) -> None:  # noqa: PLR0915 - one scenario, read top to bottom
    import warnings

    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback, ModelCheckpoint
    from lightning.pytorch.strategies import DeepSpeedStrategy

    from lightning_gockpt import GoCkptIO

    sys.path.insert(0, os.path.dirname(__file__))
    from _lightning_train import assert_bitwise_equal
    from _one_gpu import Net, to_cpu

    torch.use_deterministic_algorithms(True)

    class SaveAt(Callback):
        """Stock run: DeepSpeed's own checkpoint of step ``EVERY``."""

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            if trainer.global_step == EVERY:
                trainer.save_checkpoint(f"{root}/stock.ckpt")

    def trainer(path: str, max_steps: int, callbacks=(), io=None) -> pl.Trainer:
        return pl.Trainer(accelerator="cuda", devices=1, strategy=DeepSpeedStrategy(stage=2), max_steps=max_steps,
                          default_root_dir=path, plugins=[io] if io is not None else None,
                          callbacks=list(callbacks), logger=False, enable_progress_bar=False,
                          enable_model_summary=False,
                          enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))

    def files(path: str) -> dict:
        out = {}
        for d, _, names in os.walk(path):
            for n in names:
                if n.endswith(".pt"):
                    out[os.path.relpath(os.path.join(d, n), path)] = torch.load(
                        os.path.join(d, n), map_location="cpu", weights_only=False)
        return out

    def weights(tr: pl.Trainer) -> dict:
        return {k: v.detach().cpu().clone() for k, v in tr.lightning_module.state_dict().items()}

    pl.seed_everything(0, verbose=False)
    ref = trainer(f"{root}/ref", TOTAL, [SaveAt()])
    ref.fit(Net())

    pl.seed_everything(0, verbose=False)
    io = GoCkptIO(mode="gockpt_o")  # falls back to captures at the request, with a warning
    mc = ModelCheckpoint(dirpath=f"{root}/ckpt", filename="{step}", save_top_k=-1,
                         every_n_train_steps=EVERY, save_last=True)
    tr = trainer(f"{root}/a", STOP, [mc], io)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tr.fit(Net())
    assert any("captured at their request" in str(w.message) for w in caught)
    assert type(tr.strategy).__name__ == "GoCkptDeepSpeedStrategy"
    assert sorted(os.listdir(f"{root}/ckpt")) == ["last.ckpt", f"step={EVERY}.ckpt", f"step={STOP}.ckpt"]
    ck4 = f"{root}/ckpt/step={EVERY}.ckpt"
    got, want = files(ck4), files(f"{root}/stock.ckpt")
    assert sorted(got) == sorted(want) and got, (sorted(got), sorted(want))
    for name in want:
        g, w = got[name], want[name]
        if "module" in w:  # the model states file: Lightning's dict rides along as client state
            # (not "callbacks": only the GoCkpt run has a ModelCheckpoint)
            for key in ("loops", "lr_schedulers", "global_step", "epoch"):
                assert_bitwise_equal(g.get(key), w.get(key), f"{name}:{key}")
            assert_bitwise_equal(to_cpu(g["module"]), to_cpu(w["module"]), f"{name}:module")
        else:  # the ZeRO partition: fp32 master weights and optimizer state
            assert_bitwise_equal(to_cpu(g["optimizer_state_dict"]["single_partition_of_fp32_groups"]),
                                 to_cpu(w["optimizer_state_dict"]["single_partition_of_fp32_groups"]), name)
            assert_bitwise_equal(to_cpu(g["optimizer_state_dict"]["base_optimizer_state"]),
                                 to_cpu(w["optimizer_state_dict"]["base_optimizer_state"]), name)
    last = files(f"{root}/ckpt/last.ckpt")
    model_file = next(n for n in last if "model_states" in n)
    assert last[model_file]["global_step"] == STOP

    pl.seed_everything(0, verbose=False)
    resumed = trainer(f"{root}/b", TOTAL, [], GoCkptIO())
    resumed.fit(Net(), ckpt_path=ck4)
    assert resumed.global_step == TOTAL
    assert_bitwise_equal(weights(resumed), weights(ref), "resumed")
    print("deepspeed-ok", flush=True)


@pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None, reason="needs the deepspeed package")
def test_deepspeed_checkpoint_equals_stock_files_and_resumes_exactly(tmp_path):
    """DeepSpeedStrategy (ZeRO 2) with GoCkptIO on one GPU: the checkpoint's files equal stock's
    of the same step bit for bit, and a resume from it ends bit-identical to the uninterrupted
    stock run."""
    from _one_gpu import run_child

    run_child(__file__, str(tmp_path), ok="deepspeed-ok")


if __name__ == "__main__":
    _child(sys.argv[1])
