"""``frozen_copy="when_changed"`` under Lightning's own checkpoint rotation: a frozen part of the
model has shards of its own, which a save links from the checkpoint before where that one is
published, while ``ModelCheckpoint`` deletes the older ones (``save_top_k=1``) and rewrites
``last`` at one path; the run resumes from what is left exactly as an uninterrupted stock run
ends."""

from __future__ import annotations

import os

import lightning.pytorch as pl
import pytest
from lightning.pytorch.callbacks import ModelCheckpoint
from test_lightning_fidelity import Net, _same, _state

from lightning_gockpt import GoCkptIO


class _FrozenNet(Net):
    """The fidelity net with its first layer frozen for good (held by the optimizer, no
    gradient), as in adapter fine-tuning."""

    def __init__(self) -> None:
        super().__init__("frozen")
        self.body[0].requires_grad_(False)


def _fit(root, *, io=None, ckpt_path=None, max_steps):
    pl.seed_everything(0, verbose=False)
    model = _FrozenNet()
    cbs = [ModelCheckpoint(dirpath=str(root), filename="{step}", save_top_k=1, save_last=True,
                           every_n_train_steps=2)] if io is not None else []
    trainer = pl.Trainer(default_root_dir=str(root), max_steps=max_steps, accelerator="cpu",
                         logger=False, enable_progress_bar=False, enable_model_summary=False,
                         enable_checkpointing=bool(cbs), callbacks=cbs,
                         plugins=[io] if io else None, num_sanity_val_steps=0)
    trainer.fit(model, ckpt_path=ckpt_path)
    return trainer, model


@pytest.mark.parametrize("mode", ["lazy", "gockpt_o"])
def test_rotated_checkpoints_with_linked_frozen_shards_resume_as_stock(tmp_path, mode):
    total = 20
    ref = _state(*_fit(tmp_path / "ref", max_steps=total))
    k = 1 if mode == "lazy" else 3
    _fit(tmp_path / "a", io=GoCkptIO(mode=mode, min_overlap_steps=k, max_overlap_steps=k,
                                     frozen_copy="when_changed"), max_steps=10)
    left = sorted(n for n in os.listdir(tmp_path / "a") if n.endswith(".ckpt"))
    assert left == ["last.ckpt", "step=10.ckpt"]  # the older ones rotated away
    frozen = [os.path.join(tmp_path / "a", d, n) for d in left
              for n in os.listdir(tmp_path / "a" / d) if "-frozen-" in n]
    # The frozen layer has shards of its own in both. Whether a save linked its shard depends on
    # whether the save before had published by then (timing: tests/test_frozen_copy.py waits for
    # each save and checks the links); either way each must resume exactly.
    assert len(frozen) == 2
    for name in left:
        resumed = _state(*_fit(tmp_path / f"b-{name}", io=GoCkptIO(mode=mode), max_steps=total,
                               ckpt_path=str(tmp_path / "a" / name)))
        _same(resumed, ref)
