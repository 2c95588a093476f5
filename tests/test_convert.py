"""``gockpt.snapshot.save_tree`` with state dicts (what the Accelerate converter writes): what it writes loads bit for bit with ``load_checkpoint``, is
restored by ``Engine.restore``, and training resumed from it matches training that never
stopped.
"""

from __future__ import annotations

import pytest
import torch
from _loop import assert_state_equal, make, snapshot, train

import gockpt
from gockpt.audit import verify_checkpoint
from gockpt.snapshot import save_tree

STEPS = 4


def test_state_dicts_load_bit_for_bit_and_resume_exactly(tmp_path):
    path = str(tmp_path / "ckpt")
    model, opt, sched, scaler = make("adamw")
    train(model, opt, sched, scaler, STEPS)
    want = snapshot(model, opt)
    user = {"sched": sched.state_dict(), "scaler": scaler.state_dict(),
            "ema": torch.randn(5, dtype=torch.bfloat16)}
    save_tree(path, user, model=model.state_dict(), optimizers=[opt.state_dict()], step=STEPS,
              max_shard_bytes=4096, meta={"converted_from": "somewhere"})

    state = gockpt.load_checkpoint(path)
    assert_state_equal(state.model_state_dict, want["model"], "model")
    assert len(state.optimizer_state_dicts) == 1
    assert_state_equal(state.optimizer_state_dicts[0], want["optim"], "optimizer")
    assert_state_equal(state.extra, user, "extra")
    assert state.captured_step == STEPS
    assert state.manifest["meta"]["converted_from"] == "somewhere"
    assert sum(n.endswith(".safetensors") for n in state.manifest["files"]) > 1
    assert verify_checkpoint(path) == []

    fresh, fresh_opt, fresh_sched, fresh_scaler = make("adamw", seed=1)
    engine = gockpt.Engine(fresh, fresh_opt)
    try:
        extra = engine.restore(path)
        assert engine.version == STEPS
    finally:
        engine.close()
    assert_state_equal(fresh.state_dict(), want["model"], "restored model")
    assert_state_equal(fresh_opt.state_dict(), want["optim"], "restored optimizer")
    fresh_sched.load_state_dict(extra["sched"])
    fresh_scaler.load_state_dict(extra["scaler"])
    # Both runs go on from step STEPS with the same dropout draws: complete state, same result.
    for m, o, s, sc in ((model, opt, sched, scaler), (fresh, fresh_opt, fresh_sched, fresh_scaler)):
        torch.manual_seed(7)
        train(m, o, s, sc, STEPS + 3, start_iter=STEPS)
    assert_state_equal(snapshot(fresh, fresh_opt), snapshot(model, opt), "resumed")


def test_tied_tensors_stay_one_and_extra_state_is_kept(tmp_path):
    path = str(tmp_path / "ckpt")
    weight = torch.randn(4, 3)
    sd = {"embed.weight": weight, "head.weight": weight, "head.bias": torch.zeros(4),
          "norm._extra_state": {"version": 2}, "row": weight[1]}
    save_tree(path, None, model=sd)
    got = gockpt.load_checkpoint(path).model_state_dict
    assert_state_equal(got, sd)
    assert got["embed.weight"] is got["head.weight"]  # tied weights load tied
    assert list(got) == list(sd)


def test_a_malformed_optimizer_state_dict_is_refused_before_writing(tmp_path):
    path = tmp_path / "ckpt"
    with pytest.raises(ValueError, match=r"optimizers\[0\]"):
        save_tree(str(path), None, model={"w": torch.ones(2)}, optimizers=[{"param_groups": []}])
    assert not path.exists()
