"""The examples' data and model helpers (examples/workload.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

_PATH = Path(__file__).resolve().parents[1] / "examples" / "workload.py"
_spec = importlib.util.spec_from_file_location("gockpt_examples_workload", _PATH)
assert _spec is not None and _spec.loader is not None
common = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = common
_spec.loader.exec_module(common)


def test_default_text_is_python_docs_and_stable():
    text = common.load_text()
    assert len(text) > 100_000
    assert "for" in text and text == common.load_text()


def test_folder_text_reads_sorted_text_files_only(tmp_path):
    (tmp_path / "b.md").write_text("second")
    (tmp_path / "a.txt").write_text("first")
    (tmp_path / "skip.bin").write_text("never")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "c.py").write_text("third")
    assert common.load_text(str(tmp_path)) == "first\n\nsecond\n\nthird"
    assert common.load_text(str(tmp_path / "a.txt")) == "first"
    with pytest.raises(FileNotFoundError):
        common.load_text(str(tmp_path / "missing"))


def test_byte_tokens_round_trip():
    text = "héllo, wörld\n"
    ids = common.encode(text)
    assert ids.dtype == torch.int64 and int(ids.max()) < common.VOCAB_SIZE
    assert ids.numel() == len(text.encode("utf-8"))
    assert common.decode(ids) == text


def test_windows_cover_tokens_with_one_token_overlap():
    tokens = torch.arange(23)
    windows = common.TokenWindows(tokens, seq_len=5)
    assert len(windows) == 4
    assert windows[1].tolist() == [5, 6, 7, 8, 9, 10]
    assert windows[3][-1].item() == 20
    with pytest.raises(IndexError):
        windows[4]
    with pytest.raises(ValueError):
        common.TokenWindows(torch.arange(3), seq_len=5)


def test_split_is_positional_and_loader_order_depends_on_seed_only(tmp_path):
    (tmp_path / "t.txt").write_text("abcdefghij" * 40)
    train, val = common.text_datasets(str(tmp_path), seq_len=8, val_fraction=0.1)
    assert train.tokens.numel() == 360 and val.tokens.numel() == 40
    first = [b.clone() for b in common.make_dataloader(train, 4, seed=3)]
    again = [b.clone() for b in common.make_dataloader(train, 4, seed=3)]
    other = [b.clone() for b in common.make_dataloader(train, 4, seed=4)]
    assert all(b.shape == (4, 9) for b in first)
    assert all(torch.equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(torch.equal(a, b) for a, b in zip(first, other, strict=True))


def test_tiny_model_is_deterministic_and_learns():
    train, _ = common.text_datasets(seq_len=32)
    batch = next(iter(common.make_dataloader(train, 4, seed=0)))
    rng_before = torch.get_rng_state()
    losses = []
    for _ in range(2):
        model, loss_fn = common.build_model("tiny", seed=1)
        optimizer = common.make_optimizer(model, lr=1e-2)
        run = []
        for _ in range(5):
            loss = loss_fn(model, batch)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            run.append(loss.item())
        losses.append(run)
    assert torch.equal(torch.get_rng_state(), rng_before)
    assert losses[0] == losses[1]
    assert losses[0][-1] < losses[0][0]
    assert sum(p.numel() for p in model.parameters()) < 150_000
    assert model.config.use_cache is False


@pytest.mark.parametrize("name", common.WORKLOADS)
def test_every_workload_trains_and_its_gradients_are_the_expected_share(name):
    model, opt, step = common.build_training(name, "tiny", seed=0)
    batch = next(iter(common.make_dataloader(common.text_datasets(seq_len=32)[0], 2, seed=0)))
    before = [p.detach().clone() for g in opt.param_groups for p in g["params"]]
    loss = step(model, opt, batch)
    assert torch.isfinite(loss)
    params = [p for g in opt.param_groups for p in g["params"]]
    assert all(p.grad is None for p in params)  # zero_grad(set_to_none=True) ran
    trained = [p for p in params if opt.state.get(p)]
    changed = [p for p, b in zip(params, before, strict=True) if not torch.equal(p, b)]
    in_model = {id(p) for p in model.parameters()}
    if name == "lora":
        assert {id(p) for p in trained} == {id(p) for p in model.parameters() if p.requires_grad}
        assert all(".lora_" in n for n, p in model.named_parameters() if p.requires_grad)
        assert sum(p.numel() for p in trained) < sum(p.numel() for p in params) / 2
        assert {id(p) for p in changed} <= {id(p) for p in trained}
    elif name == "bf16-master":
        assert all(p.dtype == torch.bfloat16 for p in model.parameters())
        assert all(p.dtype == torch.float32 and id(p) not in in_model for p in params)
        for w, m in zip(model.parameters(), params, strict=True):
            assert torch.equal(w, m.to(torch.bfloat16))
    else:
        assert len(trained) == len(params) and all(id(p) in in_model for p in params)
    assert changed


def test_the_fp32_workload_is_the_default_model_and_optimizer():
    model, opt, _ = common.build_training("fp32", "tiny", seed=3)
    plain, _ = common.build_model("tiny", seed=3)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), plain.parameters(), strict=True))
    assert type(opt) is torch.optim.AdamW and opt.defaults["fused"]
    with pytest.raises(KeyError):
        common.build_training("fp8", "tiny")
