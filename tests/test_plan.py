"""The planner is pure: properties of the block split and the mode choice."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from gockpt.plan import Costs, make_plan, predict_stall_s, split_blocks


@given(st.lists(st.integers(0, 10**9), max_size=60), st.integers(1, 9))
def test_split_blocks_is_an_ordered_partition(unit_bytes, k):
    blocks = split_blocks(unit_bytes, k)
    flat = [i for b in blocks for i in b]
    assert flat == list(range(len(unit_bytes)))
    assert len(blocks) == (min(k, len(unit_bytes)) if unit_bytes else 1)
    assert all(blocks) or not unit_bytes


@given(st.lists(st.integers(1, 1000), min_size=20, max_size=60), st.integers(2, 7))
def test_split_blocks_balances_bytes(unit_bytes, k):
    blocks = split_blocks(unit_bytes, k)
    sizes = [sum(unit_bytes[i] for i in b) for b in blocks]
    # Within one unit of the ideal share.
    assert max(sizes) <= sum(unit_bytes) / len(blocks) + max(unit_bytes)


def test_lazy_without_costs_and_when_copy_hides_in_window():
    units, grads = [100] * 8, [25] * 8
    assert make_plan("auto", units, grads, None, max_overlap_steps=7, replayable=True).mode == "lazy"
    fast = Costs(copy_bytes_per_s=1e6, window_s=1.0)
    p = make_plan("auto", units, grads, fast, max_overlap_steps=7, replayable=True)
    assert p.mode == "lazy" and p.predicted_stall_s == 0


def test_auto_spreads_copy_over_steps_when_it_exceeds_one_window():
    # 800 bytes at 100 B/s = 8 s of copy, 2 s windows, small gradients (GoCkpt Table 1 regime).
    units, grads = [100] * 8, [10] * 8
    costs = Costs(copy_bytes_per_s=100, window_s=2.0)
    p = make_plan("auto", units, grads, costs, max_overlap_steps=7, replayable=True)
    lazy = make_plan("lazy", units, grads, costs, max_overlap_steps=7, replayable=True)
    assert p.mode in ("gockpt", "gockpt_o") and p.num_overlap_steps > 1
    assert p.predicted_stall_s < lazy.predicted_stall_s


def test_overlapped_gradient_copy_never_predicts_more_stall():
    units, grads = [100] * 8, [30] * 8
    for w in (0.0, 0.5, 1.0, 3.0):
        costs = Costs(copy_bytes_per_s=100, window_s=w)
        for k in range(1, 8):
            blocks = split_blocks(units, k)
            assert predict_stall_s("gockpt_o", units, grads, blocks, costs) <= \
                predict_stall_s("gockpt", units, grads, blocks, costs) + 1e-12


def test_unreplayable_falls_back_to_lazy_and_bounds_respected():
    costs = Costs(copy_bytes_per_s=100, window_s=2.0)
    assert make_plan("gockpt", [100] * 8, [10] * 8, costs, max_overlap_steps=7,
                     replayable=False).mode == "lazy"
    p = make_plan("gockpt", [100] * 8, [10] * 8, costs, max_overlap_steps=5, replayable=True,
                  min_overlap_steps=4)
    assert 4 <= p.num_overlap_steps <= 5
    with pytest.raises(ValueError):
        make_plan("bogus", [1], [1], None, max_overlap_steps=3, replayable=True)
