"""The state tree a capture takes (gockpt.snapshot.to_skeleton): an independent copy, attributes kept."""

from __future__ import annotations

import threading
from collections import OrderedDict

import torch
from torch import nn

from gockpt.snapshot import REF, storage_key, to_skeleton


def test_a_state_dicts_metadata_is_copied_deeply_with_the_tree():
    model = nn.Sequential(nn.Linear(3, 4), nn.BatchNorm1d(4))
    sd = model.state_dict(keep_vars=True)
    live = {storage_key(sd["0.weight"]): "model.0.weight"}
    skel = to_skeleton(sd, live)
    assert type(skel) is type(sd) and list(skel) == list(sd)
    assert skel["0.weight"] == {REF: "model.0.weight", "stride": None}
    assert torch.equal(skel["1.running_var"], sd["1.running_var"])
    assert skel["1.running_var"].data_ptr() != sd["1.running_var"].data_ptr()
    # load_state_dict reads the per-module versions from _metadata (BatchNorm's migration).
    assert skel._metadata == sd._metadata and skel._metadata["1"]["version"] == 2
    sd._metadata["1"]["version"] = 99  # the live tree changes after the capture
    sd._metadata["extra"] = {}
    assert skel._metadata["1"]["version"] == 2 and "extra" not in skel._metadata


class _Marker:
    """A class local to this test module's namespace, holding an unpicklable lock."""

    def __init__(self, n: int) -> None:
        self.n, self.lock = n, threading.Lock()

    def __deepcopy__(self, memo: dict) -> _Marker:
        return _Marker(self.n)


def test_attributes_that_do_not_pickle_are_copied_as_deepcopy_copies_them():
    tree = OrderedDict(w=torch.ones(2))
    tree.note = {"m": _Marker(7)}  # type: ignore[attr-defined]
    skel = to_skeleton(tree, {})
    assert skel.note["m"].n == 7 and skel.note["m"] is not tree.note["m"]
    assert skel.note is not tree.note


def test_strides_of_a_stored_view_come_back_and_hostile_ones_are_refused():
    import pytest

    from gockpt.errors import CheckpointCorruptError
    from gockpt.snapshot import resolve

    w = torch.arange(12.0).reshape(3, 4)
    t = w.t()  # (4, 3), strides (1, 4): a dense permutation
    tree = {"t": {REF: "model.t", "stride": list(t.stride())}, "col": {REF: "model.c", "stride": [4]}}
    stored = {"model.t": t.contiguous(), "model.c": w[:, 1].contiguous()}
    out = resolve(tree, stored, "ckpt")
    assert out["t"].stride() == t.stride() and torch.equal(out["t"], t)
    assert out["col"].stride() == (4,) and torch.equal(out["col"], w[:, 1])  # a view with gaps
    for stride, why in (([10**11, 1], "span"), ([0, 0], "overlap"), ([1, 1], "overlap"),
                        ([True, 1], "malformed")):
        bad = {"t": {REF: "model.t", "stride": stride}}
        with pytest.raises(CheckpointCorruptError, match=f"ckpt: .*{why}.*|ckpt: malformed") as e:
            resolve(bad, stored, "ckpt")
        assert "model.t" in str(e.value)


def test_untracked_views_share_a_storage_and_parameters_stay_parameters_as_torch_save_keeps_them():
    import io

    from gockpt.snapshot import resolve

    tracked = nn.Parameter(torch.randn(3, 4))
    tracked_leaf = torch.randn(2, requires_grad=True)
    other = torch.randn(4, 5)
    z = torch.tensor([1 + 2j, 3 - 4j])
    tree = {"param": nn.Parameter(torch.randn(3)), "frozen": nn.Parameter(torch.ones(2), requires_grad=False),
            "a": other[1], "b": other[:, 2], "whole": other, "conj": z.conj(),
            "neg": torch.tensor([1.0, 2.0])._neg_view(), "leaf": torch.randn(2, requires_grad=True),
            "tracked": tracked, "tracked_plain": tracked.detach(), "tracked_leaf": tracked_leaf}
    live = {storage_key(tracked): "model.w", storage_key(tracked_leaf): "optim.0.0.__param__"}
    skeleton = to_skeleton(tree, live, keep_params=True)
    assert skeleton["tracked"] == {REF: "model.w", "stride": None, "param": True}
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    buf.seek(0)
    back = resolve(torch.load(buf, weights_only=True), {"model.w": tracked.detach().clone(),
                                                         "optim.0.0.__param__": tracked_leaf.detach().clone()}, "ckpt")
    stock = torch.load(io.BytesIO(_saved(tree)), weights_only=True)
    for k in tree:
        assert type(back[k]) is type(stock[k]), k
        assert back[k].requires_grad == stock[k].requires_grad, k
        assert torch.equal(back[k], stock[k]) and back[k].stride() == stock[k].stride(), k
    assert back["a"].untyped_storage().data_ptr() == back["whole"].untyped_storage().data_ptr()
    assert back["b"].storage_offset() == stock["b"].storage_offset() == 2
    model_tree = to_skeleton({"w": tracked}, {storage_key(tracked): "model.w"})  # a state_dict
    assert model_tree["w"] == {REF: "model.w", "stride": None}


def _saved(tree) -> bytes:
    import io

    buf = io.BytesIO()
    torch.save(tree, buf)
    return buf.getvalue()


def test_a_mapping_that_builds_a_new_container_per_access_keeps_each_value():
    """A dict subclass whose ``__getitem__`` makes a fresh list each time: the copy of one key
    is never given to another (a container's id is not reused while the walk holds it)."""
    from gockpt.snapshot import map_tree

    class Lazy(dict):
        def __getitem__(self, k):
            return [super().__getitem__(k)]

    assert dict(map_tree(Lazy(a=1, b=2, c=3), lambda x: x)) == {"a": [1], "b": [2], "c": [3]}
    skeleton = to_skeleton({"hp": Lazy(a=torch.ones(1), b=torch.zeros(1))}, {}, keep_params=True)
    stored = dict(dict.items(skeleton["hp"]))  # as stored, not through the subclass's access
    assert torch.equal(stored["a"][0], torch.ones(1)) and torch.equal(stored["b"][0], torch.zeros(1))
