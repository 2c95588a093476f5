"""A non-writing process's share of a checkpoint, taken at the writer's captured step."""

from __future__ import annotations

import torch

from gockpt.ranks import RankCapture, write_share


def test_the_share_is_taken_at_the_captured_step_and_written_into_the_staging(tmp_path):
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = []

    def take():
        taken.append(rank.version)
        return {"version": rank.version, "rng": torch.get_rng_state()}

    rank = RankCapture([model], [opt], take, "random_states_1.pkl")
    staging = tmp_path / ".0-ckpt.gockpt-tmp-1-ab"
    staging.mkdir()
    rank.add(0, str(staging), target=2)  # the writer captures after two more updates
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()  # forward pre-hook: a boundary
        opt.step()
        opt.zero_grad()
    rank.wait()
    assert taken == [2]
    saved = torch.load(staging / "random_states_1.pkl")
    assert saved["version"] == 2 and not [p for p in staging.iterdir() if ".tmp-" in p.name]
    # An abandoned checkpoint (its staging removed by the writer) is skipped, not an error.
    rank.add(1, str(tmp_path / "gone"), target=rank.version)
    rank.boundary()
    rank.close()
    assert write_share(str(tmp_path / "gone"), "x.pkl", {}) is False
