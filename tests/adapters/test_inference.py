"""lightning_gockpt.load_from_checkpoint: cls.load_from_checkpoint for GoCkpt checkpoint directories."""

from __future__ import annotations

import pytest
import torch
from _lightning_train import TinyNet, assert_bitwise_equal, fit

import lightning_gockpt
from lightning_gockpt import GoCkptIO


class InferenceNet(TinyNet):
    """TinyNet without its training-RNG restore: inference has no use for it."""

    def on_load_checkpoint(self, checkpoint):
        self.loaded_step = checkpoint["global_step"]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    root = tmp_path_factory.mktemp("inference")
    fit(str(root), io=GoCkptIO(mode="lazy"), max_steps=4, ckpt_every=4)
    return root / "step=4.ckpt"


def test_loads_a_gockpt_directory_like_the_stock_method_loads_a_file(checkpoint, tmp_path):
    want = GoCkptIO().load_checkpoint(checkpoint)
    model = lightning_gockpt.load_from_checkpoint(InferenceNet, checkpoint)
    assert isinstance(model, InferenceNet) and model.loaded_step == 4
    assert_bitwise_equal(model.state_dict(), want["state_dict"], "state_dict")
    assert model.hparams.lr == want["hyper_parameters"]["lr"]
    override = lightning_gockpt.load_from_checkpoint(InferenceNet, str(checkpoint), lr=0.3)
    assert override.hparams.lr == 0.3
    # A file goes to the stock method unchanged.
    file = tmp_path / "model.ckpt"
    torch.save(want, file)
    stock = lightning_gockpt.load_from_checkpoint(InferenceNet, file, map_location="cpu")
    assert_bitwise_equal(stock.state_dict(), want["state_dict"], "file")


def test_missing_checkpoint_raises(tmp_path):
    with pytest.raises(FileNotFoundError):
        lightning_gockpt.load_from_checkpoint(InferenceNet, tmp_path / "nope.ckpt")
