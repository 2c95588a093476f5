"""``frozen_copy="when_changed"``: tensors the reused host slot still holds are not copied again,
and every checkpoint still equals a blocking save of its captured step, bit for bit."""

from __future__ import annotations

import pytest
import torch
from _loop import assert_state_equal, snapshot
from torch import nn

import gockpt
from gockpt import Engine, GoCkptConfig


class Adapted(nn.Module):
    """A frozen base (``base`` outside the optimizer, ``mid`` inside it but frozen), a constant
    buffer, BatchNorm (its running stats change every step) and trainable low-rank adapters."""

    def __init__(self) -> None:
        super().__init__()
        self.base = nn.Linear(16, 16)
        self.mid = nn.Linear(16, 16)
        self.norm = nn.BatchNorm1d(16)
        self.register_buffer("table", torch.randn(64))
        self.a = nn.Parameter(torch.randn(4, 16) / 4)
        self.b = nn.Parameter(torch.zeros(16, 4))
        for p in (*self.base.parameters(), *self.mid.parameters()):
            p.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.base(x) + x @ self.a.T @ self.b.T
        return self.mid(self.norm(torch.relu(h))) + self.table[:16]


def _frozen_bytes(model: Adapted) -> int:
    """Frozen parameters; buffers (``table`` too) are always copied: BatchNorm's running
    statistics change in place without a version bump."""
    return sum(t.numel() * t.element_size() for t in (*model.base.parameters(), *model.mid.parameters()))


def _train(model, opt, eng, steps: int, *, on_step_end) -> None:
    g = torch.Generator().manual_seed(3)
    for it in range(steps):
        x = torch.randn(8, 16, generator=g)
        model(x).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        on_step_end(it)


@pytest.mark.parametrize("mode", ["async", "lazy", "gockpt_o"])
def test_unchanged_frozen_tensors_are_not_copied_again_and_checkpoints_stay_exact(tmp_path, mode):
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([*model.mid.parameters(), model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode=mode, frozen_copy="when_changed", min_overlap_steps=3,
                                          max_overlap_steps=3, max_shard_bytes=4096))
    live: dict[int, dict] = {}
    metrics = []

    def on_step_end(it: int) -> None:
        live[eng.version] = snapshot(model, opt)
        if it == 6:
            # An edit outside the optimizer between two saves: the next one copies it again.
            with torch.no_grad():
                model.base.weight.mul_(2)
        if it in (1, 4, 7, 10):
            metrics.append(eng.save(str(tmp_path / f"ckpt-{it}")).result())

    _train(model, opt, eng, 14, on_step_end=on_step_end)
    eng.close()
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")
    frozen = _frozen_bytes(model)
    edited = model.base.weight.numel() * 4
    assert [m.unchanged_bytes for m in metrics] == [0, frozen, frozen - edited, frozen]
    assert metrics[1].state_bytes == metrics[0].state_bytes - frozen


def test_a_swap_of_two_frozen_tensors_of_one_shape_is_copied_again(tmp_path):
    """Same keys, same shapes, same version counters, other tensors: nothing is taken as held."""
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy", frozen_copy="when_changed"))
    live: dict[int, dict] = {}
    metrics = []

    def on_step_end(it: int) -> None:
        if it == 3:
            model.base, model.mid = model.mid, model.base
        live[eng.version] = snapshot(model, opt)
        if it in (1, 4, 6):
            metrics.append(eng.save(str(tmp_path / f"ckpt-{it}")).result())

    _train(model, opt, eng, 8, on_step_end=on_step_end)
    eng.close()
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[state.captured_step]["model"], m.path)
    frozen = sum(p.numel() * 4 for p in (*model.base.parameters(), *model.mid.parameters()))
    assert [m.unchanged_bytes for m in metrics] == [0, 0, frozen]


def test_default_copies_everything_every_time(tmp_path):
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy"))
    metrics = []
    _train(model, opt, eng, 6, on_step_end=lambda it: it in (1, 4) and metrics.append(
        eng.save(str(tmp_path / f"ckpt-{it}")).result()))
    eng.close()
    assert [m.unchanged_bytes for m in metrics] == [0, 0]
    assert metrics[0].state_bytes == metrics[1].state_bytes


def test_frozen_copy_is_checked():
    with pytest.raises(ValueError, match="frozen_copy"):
        GoCkptConfig(frozen_copy="never")


def test_a_slot_regrown_for_more_gradient_windows_keeps_what_it_holds(tmp_path):
    """A later save with more windows needs larger gradient buffers: the slot is rebuilt around
    the same data buffer, whose frozen tensors are still not copied again."""
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([*model.mid.parameters(), model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="gockpt_o", frozen_copy="when_changed",
                                          min_overlap_steps=3, max_overlap_steps=3))
    live: dict[int, dict] = {}
    handles = []

    def on_step_end(it: int) -> None:
        live[eng.version] = snapshot(model, opt)
        if it in (1, 5):  # the first save is durable before the second (3 steps later)
            k = 2 if it == 1 else 3
            handles.append(eng.save(str(tmp_path / f"ckpt-{it}"), max_overlap_steps=k))
        if it == 4:
            handles[0].result()

    _train(model, opt, eng, 9, on_step_end=on_step_end)
    metrics = [h.result() for h in handles]
    eng.close()
    assert [m.num_overlap_steps for m in metrics] == [2, 3]
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        v = state.captured_step
        assert_state_equal(state.model_state_dict, live[v]["model"], f"model@{v}")
        assert_state_equal(state.optimizer_state_dicts[0], live[v]["optim"], f"optim@{v}")
    assert [m.unchanged_bytes for m in metrics] == [0, _frozen_bytes(model)]
