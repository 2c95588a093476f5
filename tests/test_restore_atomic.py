"""A restore that does not fit the live optimizers fails before it writes anything: the model's
tensors and the optimizers' state are left exactly as they were."""

from __future__ import annotations

import copy

import pytest
import torch
from _loop import assert_state_equal
from torch import nn

import gockpt


def _model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 8)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


@pytest.fixture
def saved(tmp_path):
    """A checkpoint of a model trained by AdamW with one parameter group."""
    model = _model(0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    path = str(tmp_path / "ckpt")
    with gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync")) as engine:
        for _ in range(2):
            _train_step(model, opt)
            engine.step_end()
        engine.save(path).result()
    return path


def _bits(tree):
    """Every tensor of ``tree`` as raw bytes (bit-for-bit comparison, NaN-proof)."""
    if isinstance(tree, torch.Tensor):
        return tree.detach().reshape(-1).contiguous().view(torch.uint8).clone()
    if isinstance(tree, dict):
        return {k: _bits(v) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return [_bits(v) for v in tree]
    return copy.deepcopy(tree)


def _split_by_decay(model: nn.Module) -> list[dict]:
    decay = [p for n, p in model.named_parameters() if n.endswith("weight")]
    no_decay = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": decay}, {"params": no_decay, "weight_decay": 0.0}]


def _uneven_groups(model: nn.Module) -> list[dict]:
    params = list(model.parameters())
    return [{"params": params[:1]}, {"params": params[1:]}]


@pytest.mark.parametrize(
    "groups, fragment",
    [
        (_split_by_decay, "has 1 parameter group(s), the live optimizer 0 has 2"),
        (lambda m: [{"params": list(m.parameters())[:3]}], "parameter group 0: 4 parameter(s)"),
    ],
    ids=["two groups", "fewer parameters"],
)
def test_engine_restore_with_other_param_groups_leaves_everything_untouched(
        saved, groups, fragment):
    model = _model(1)
    opt = torch.optim.AdamW(groups(model), lr=1e-3)
    _train_step(model, opt)  # live optimizer state that must survive too
    before_model, before_opt = _bits(model.state_dict()), _bits(opt.state_dict())
    with gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync")) as engine:
        version = engine.version
        with pytest.raises(ValueError, match="checkpoint optimizer 0") as info:
            engine.restore(saved)
        assert fragment in str(info.value)
        assert engine.version == version
    assert_state_equal(_bits(model.state_dict()), before_model, "model")
    assert_state_equal(_bits(opt.state_dict()), before_opt, "optimizer")


def test_load_into_checks_every_optimizer_before_loading_any(saved):
    state = gockpt.load_checkpoint(saved)
    two = gockpt.load_checkpoint(saved)
    # Two optimizers in the checkpoint: the first fits, the second's groups do not.
    state.optimizer_state_dicts.append(copy.deepcopy(two.optimizer_state_dicts[0]))
    model = _model(1)
    params = list(model.parameters())
    fits = torch.optim.AdamW(params, lr=1e-3)
    other = torch.optim.SGD(_uneven_groups(model), lr=0.1)
    before = _bits(model.state_dict()), _bits(fits.state_dict()), _bits(other.state_dict())
    with pytest.raises(ValueError, match="checkpoint optimizer 1 has 1 parameter group"):
        gockpt.load_into(model, [fits, other], state)
    after = _bits(model.state_dict()), _bits(fits.state_dict()), _bits(other.state_dict())
    assert_state_equal(after, before)


def test_a_matching_restore_still_loads(saved):
    model = _model(1)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    want = gockpt.load_checkpoint(saved)
    with gockpt.Engine(model, opt, gockpt.GoCkptConfig(mode="sync")) as engine:
        engine.restore(saved)
        assert engine.version == want.captured_step == 2
    assert_state_equal(_bits(model.state_dict()), _bits(want.model_state_dict), "model")
