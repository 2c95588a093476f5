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


def _lazy_saves_around(tmp_path, change) -> tuple[Adapted, list]:
    """8 steps of ``Adapted`` under ``lazy`` with ``frozen_copy="when_changed"``, ``change(model)``
    at the end of step 3, saves at steps 1, 4 and 6, each checked against the live state of its
    step; returns the model and the saves' metrics."""
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, GoCkptConfig(mode="lazy", frozen_copy="when_changed"))
    live: dict[int, dict] = {}
    metrics = []

    def on_step_end(it: int) -> None:
        if it == 3:
            change(model)
        live[eng.version] = snapshot(model, opt)
        if it in (1, 4, 6):
            metrics.append(eng.save(str(tmp_path / f"ckpt-{it}")).result())

    _train(model, opt, eng, 8, on_step_end=on_step_end)
    eng.close()
    for m in metrics:
        state = gockpt.load_checkpoint(m.path)
        assert_state_equal(state.model_state_dict, live[state.captured_step]["model"], m.path)
    return model, metrics


def test_a_swap_of_two_frozen_tensors_of_one_shape_is_copied_again(tmp_path):
    """Same keys, same shapes, same version counters, other tensors: nothing is taken as held."""
    def swap(model: Adapted) -> None:
        model.base, model.mid = model.mid, model.base

    model, metrics = _lazy_saves_around(tmp_path, swap)
    frozen = sum(p.numel() * 4 for p in (*model.base.parameters(), *model.mid.parameters()))
    assert [m.unchanged_bytes for m in metrics] == [0, 0, frozen]


@pytest.mark.parametrize("how", ["swap_tensors", "load_state_dict"])
def test_frozen_tensors_held_by_a_slot_can_still_be_swapped(tmp_path, how):
    """``torch.utils.swap_tensors`` (and ``load_state_dict`` under torch's swap-on-conversion
    future) refuses a tensor with a weak reference: a slot holding a frozen parameter must not
    put one on it. The swapped tensor is copied again at the next save."""
    def swap(model: Adapted) -> None:
        if how == "swap_tensors":
            w = model.base.weight
            torch.utils.swap_tensors(w, nn.Parameter(w.detach() * 0.5, requires_grad=False))
            return
        torch.__future__.set_swap_module_params_on_conversion(True)
        try:
            model.base.load_state_dict({k: v * 0.5 for k, v in model.base.state_dict().items()})
        finally:
            torch.__future__.set_swap_module_params_on_conversion(False)

    model, metrics = _lazy_saves_around(tmp_path, swap)
    swapped = sum(p.numel() * 4 for p in ([model.base.weight] if how == "swap_tensors"
                                         else model.base.parameters()))
    assert [m.unchanged_bytes for m in metrics] == [0, _frozen_bytes(model) - swapped, _frozen_bytes(model)]


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


# --- shards of unchanged frozen tensors: linked from the checkpoint before, not written ------

def _frozen_shard(path) -> str:
    """The one shard file of frozen tensors in checkpoint ``path``."""
    import os

    names = [n for n in os.listdir(path) if "-frozen-" in n]
    assert len(names) == 1, os.listdir(path)
    return os.path.join(path, names[0])


def _run_saves(tmp_path, mode, paths_at, *, between=None, config=None, steps=14):
    """Train ``Adapted`` for ``steps`` steps, saving at ``paths_at`` (step -> path, waiting for
    each); ``between(it)`` runs before the save of step ``it``. Returns the metrics and the
    live state per version."""
    torch.manual_seed(0)
    model = Adapted()
    opt = torch.optim.AdamW([*model.mid.parameters(), model.a, model.b], lr=1e-2)
    eng = Engine(model, opt, config or GoCkptConfig(
        mode=mode, frozen_copy="when_changed", min_overlap_steps=3, max_overlap_steps=3,
        max_shard_bytes=4096))
    live: dict[int, dict] = {}
    metrics = []

    def on_step_end(it: int) -> None:
        live[eng.version] = snapshot(model, opt)
        if between is not None:
            between(it, model)
        if it in paths_at:
            metrics.append(eng.save(str(paths_at[it])).result())
            loaded = gockpt.load_checkpoint(metrics[-1].path)  # as it is now, before later saves
            v = loaded.captured_step
            assert_state_equal(loaded.model_state_dict, live[v]["model"], f"{mode}:model@{v}")
            assert_state_equal(loaded.optimizer_state_dicts[0], live[v]["optim"], f"{mode}:optim@{v}")

    _train(model, opt, eng, steps, on_step_end=on_step_end)
    eng.close()
    return metrics, live


@pytest.mark.parametrize("mode", ["sync", "async", "lazy", "gockpt_o"])
def test_shards_of_unchanged_frozen_tensors_are_linked_and_every_checkpoint_loads_exactly(tmp_path, mode):
    import os

    def between(it, model):
        if it == 6:  # an edit of a frozen tensor: the next save writes its shard again
            with torch.no_grad():
                model.base.weight.mul_(2)

    paths = {it: tmp_path / f"ckpt-{it}" for it in (1, 4, 7, 10)}
    metrics, live = _run_saves(tmp_path, mode, paths, between=between)
    files = [_frozen_shard(p) for p in paths.values()]
    size = os.path.getsize(files[0])
    assert [m.linked_bytes for m in metrics] == [0, size, 0, size]
    assert [m.log_dict()["gockpt/linked_bytes"] for m in metrics] == [0, size, 0, size]
    ino = [os.stat(f).st_ino for f in files]
    assert ino[0] == ino[1] and ino[2] == ino[3] and ino[1] != ino[2]
    assert metrics[1].persist_bytes < metrics[0].persist_bytes  # not counted as written
    # Each checkpoint still loads exactly once the others are gone (rotation).
    for m in metrics[:-1]:
        gockpt.remove_checkpoint(m.path)
    state = gockpt.load_checkpoint(metrics[-1].path)
    v = state.captured_step
    assert_state_equal(state.model_state_dict, live[v]["model"], f"{mode}:model@{v} alone")


def test_saves_to_one_path_link_from_the_checkpoint_they_replace(tmp_path):
    """``last``-style: every save replaces the checkpoint its frozen shard links to."""
    import os

    path = tmp_path / "last"
    metrics, _ = _run_saves(tmp_path, "lazy", {1: path, 4: path, 7: path})  # each loads exactly
    assert [m.linked_bytes > 0 for m in metrics] == [False, True, True]
    assert os.stat(_frozen_shard(path)).st_nlink == 1  # the replaced checkpoints are gone
    assert sorted(os.listdir(tmp_path)) == ["last", "latest"]  # no staging left behind


def test_an_origin_removed_replaced_or_modified_since_is_written_not_linked(tmp_path):
    import os
    import shutil

    paths = {it: tmp_path / f"ckpt-{it}" for it in (1, 3, 5, 7, 9)}

    def between(it, model):
        if it == 3:  # rotated away before the next save
            shutil.rmtree(paths[1])
        elif it == 5:  # replaced by a copy (another inode, same bytes)
            f = _frozen_shard(paths[3])
            shutil.copyfile(f, f + ".tmp")
            os.replace(f + ".tmp", f)
        elif it == 7:  # modified in place since (its modification time moved)
            f = _frozen_shard(paths[5])
            st = os.stat(f)
            os.utime(f, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))
        elif it == 9:  # a symlink to a regular copy in its place
            f = _frozen_shard(paths[7])
            shutil.copyfile(f, str(tmp_path / "elsewhere"))
            os.remove(f)
            os.symlink(tmp_path / "elsewhere", f)

    metrics, _ = _run_saves(tmp_path, "lazy", paths, between=between, steps=11)
    assert [m.linked_bytes for m in metrics[1:]] == [0, 0, 0, 0]  # each written, each exact
    assert not os.path.islink(_frozen_shard(paths[9]))


def test_object_stores_write_every_shard(tmp_path):
    """No links outside the local filesystem (``memory://`` here): the shards are written."""
    import uuid

    root = f"memory://frozen-{uuid.uuid4().hex}"
    metrics, _ = _run_saves(tmp_path, "lazy", {1: f"{root}/a", 4: f"{root}/b"})
    assert [m.linked_bytes for m in metrics] == [0, 0]
    assert metrics[1].unchanged_bytes > 0  # the copy is still skipped


def test_without_when_changed_frozen_tensors_share_shards_as_before(tmp_path):
    import os

    paths = {1: tmp_path / "a", 4: tmp_path / "b"}
    metrics, _ = _run_saves(tmp_path, "lazy", paths, config=GoCkptConfig(mode="lazy", max_shard_bytes=4096))
    assert [m.linked_bytes for m in metrics] == [0, 0]
    assert not [n for p in paths.values() for n in os.listdir(p) if "-frozen-" in n]


@pytest.mark.parametrize("mode", ["async", "lazy"])
def test_a_slot_rebuilt_on_new_memory_holds_nothing_of_the_old_one(tmp_path, mode):
    """A frozen module attached mid-run grows the layout past the slot's data buffer: the new
    buffer is fresh memory, so nothing the dropped slot held may be taken as held (its frozen
    tensors would be written from uninitialized memory once the checkpoint they could link
    from is gone)."""
    torch.manual_seed(0)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.base = nn.Linear(64, 64).requires_grad_(False)  # frozen, outside the optimizer
            self.a = nn.Parameter(torch.randn(64, 64) / 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base(x) + x @ self.a

    model = M()
    opt = torch.optim.AdamW([model.a], lr=1e-2)
    # One shard per module: the attached one gets a shard of its own, base's keeps its offsets.
    eng = Engine(model, opt, GoCkptConfig(mode=mode, frozen_copy="when_changed",
                                          max_shard_bytes=64 * 64 * 4 + 64 * 4))
    g = torch.Generator().manual_seed(3)
    live, metrics = {}, []
    for it in range(6):
        model(torch.randn(8, 64, generator=g)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        eng.step_end()
        if it == 2:
            model.extra = nn.Linear(64, 64).requires_grad_(False)  # e.g. a frozen head attached
        if it == 3:
            gockpt.remove_checkpoint(str(tmp_path / "ckpt-1"))  # rotation
        live[eng.version] = snapshot(model, opt)
        if it in (1, 4):
            metrics.append(eng.save(str(tmp_path / f"ckpt-{it}")).result())
    eng.close()
    state = gockpt.load_checkpoint(metrics[-1].path)
    assert_state_equal(state.model_state_dict, live[state.captured_step]["model"], mode)
    assert metrics[-1].unchanged_bytes == 0  # a new buffer: everything copied
