"""A non-writing process's share of a checkpoint, taken at the writer's captured step."""

from __future__ import annotations

import pytest
import torch

from gockpt.ranks import (
    RankCapture,
    describe_request,
    exchange_request,
    wait_for_shares,
    write_share,
)


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


def test_a_missing_share_times_out_naming_it(tmp_path):
    (tmp_path / "random_states_1.pkl").write_bytes(b"x")
    with pytest.raises(TimeoutError, match="random_states_2.pkl"):
        wait_for_shares(str(tmp_path), ["random_states_1.pkl", "random_states_2.pkl"], timeout_s=0.05)
    wait_for_shares(str(tmp_path), ["random_states_1.pkl"], timeout_s=0.05)  # present: returns


def test_the_writers_error_is_raised_on_every_process():
    desc = describe_request(3, error=ValueError("exists"))
    sent = []

    def broadcast(obj):  # what every other process receives
        sent.append(obj)
        return obj

    with pytest.raises(ValueError, match="exists"):
        exchange_request(desc, broadcast)
    assert sent[0]["error"] == "ValueError: exists"  # text: exceptions need not pickle
    with pytest.raises(RuntimeError, match="ValueError: exists"):
        exchange_request(None, lambda _obj: sent[0])


def test_a_writer_and_a_share_taker_checkpoint_one_step_together(tmp_path):
    """Two ReplicatedEngines, writer and other, in one process: one folder with both parts."""
    from gockpt import GoCkptConfig
    from gockpt.replicated import ReplicatedEngine
    from gockpt.writer import CheckpointWriter

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    config = GoCkptConfig(mode="gockpt", min_overlap_steps=2, max_overlap_steps=2, update_latest=False)
    box: list = []
    writer_rep = ReplicatedEngine(models[0], opts[0:1], config, is_writer=True, broadcast=lambda o: box.append(o) or o)
    other = ReplicatedEngine(models[1], opts[1:2], config, is_writer=False, share=lambda: {"rank": 1},
                             share_name="share_1.pt", broadcast=lambda _o: box[-1])
    staging = tmp_path / ".0-ckpt.gockpt-tmp-1-ab"

    class Writer(CheckpointWriter):
        def before_publish(self, snapshot):
            wait_for_shares(str(staging), ["share_1.pt"], timeout_s=30)

    def prepare():
        staging.mkdir()
        writer = Writer()
        writer.staging = str(staging)
        return str(staging), writer

    def step():
        for m, o in zip(models, opts, strict=True):
            m(torch.ones(1, 4)).sum().backward()
            o.step()
            o.zero_grad()

    step()
    handle = writer_rep.save(str(tmp_path / "ckpt"), prepare)
    other.save(str(tmp_path / "ckpt"), prepare)
    for _ in range(3):
        step()
    other.wait(30)
    assert [m.captured_step for m in writer_rep.wait(30)] == [2]  # K = 2: one update later
    assert handle is not None and handle.done()
    assert torch.load(tmp_path / "ckpt" / "share_1.pt") == {"rank": 1}
    assert [m.path for m in writer_rep.take_published()] == [str(tmp_path / "ckpt")]
    assert writer_rep.take_published() == []
    writer_rep.close()
    other.close()


@pytest.mark.parametrize("fails", [False, True])
def test_a_sync_save_of_two_processes_is_durable_when_it_returns_and_its_failure_raised_on_both(tmp_path, fails):
    """Mode sync: the writer's blocking save must not wait, inside its request, for the share
    the other process writes only after the request's exchange (a deadlock until the publish
    timeout). The checkpoint is durable when save returns on both; a failed write raises on both."""
    import threading

    from gockpt import GoCkptConfig
    from gockpt.replicated import ReplicatedEngine
    from gockpt.writer import CheckpointWriter

    class Broadcast:  # two processes' broadcast_object_list, as threads
        def __init__(self):
            self.barrier, self.obj = threading.Barrier(2, timeout=30), None

        def writer(self, obj):
            self.obj = obj
            self.barrier.wait()
            self.barrier.wait()
            return obj

        def other(self, _obj):
            self.barrier.wait()
            obj = self.obj
            self.barrier.wait()
            return obj

    torch.manual_seed(0)
    models = [torch.nn.Linear(4, 4) for _ in range(2)]
    models[1].load_state_dict(models[0].state_dict())
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    config = GoCkptConfig(mode="sync", update_latest=False)
    b = Broadcast()
    writer_rep = ReplicatedEngine(models[0], opts[0:1], config, is_writer=True, broadcast=b.writer)
    other = ReplicatedEngine(models[1], opts[1:2], config, is_writer=False, share=lambda: {"rank": 1},
                             share_name="share_1.pt", broadcast=b.other)
    staging = tmp_path / ".0-ckpt.gockpt-tmp-1-ab"

    class Writer(CheckpointWriter):
        def before_publish(self, snapshot):
            wait_for_shares(str(staging), ["share_1.pt"], timeout_s=20)
            if fails:
                raise OSError(28, "No space left on device")

    def prepare():
        staging.mkdir()
        writer = Writer()
        writer.staging = str(staging)
        return str(staging), writer

    for m, o in zip(models, opts, strict=True):
        m(torch.ones(1, 4)).sum().backward()
        o.step()
    outcome = {}

    def run_other():
        try:
            other.save(str(tmp_path / "ckpt"), prepare)
            outcome["other"] = None
        except BaseException as e:  # noqa: BLE001 - inspected below
            outcome["other"] = e

    t = threading.Thread(target=run_other)
    t.start()
    try:
        handle = writer_rep.save(str(tmp_path / "ckpt"), prepare)
        outcome["writer"] = None
    except BaseException as e:  # noqa: BLE001 - inspected below
        outcome["writer"] = e
    t.join(30)
    assert not t.is_alive()
    if fails:
        assert "No space left" in str(outcome["writer"]), outcome
        assert isinstance(outcome["other"], RuntimeError) and "No space left" in str(outcome["other"]), outcome
        assert not (tmp_path / "ckpt").exists()
    else:
        assert outcome == {"writer": None, "other": None}
        assert handle.done() and handle.result().stall_by_phase_s.get("persist", 0) > 0
        assert torch.load(tmp_path / "ckpt" / "share_1.pt") == {"rank": 1}
    for rep in (writer_rep, other):
        try:
            rep.close()
        except BaseException:  # noqa: BLE001 - the failed save's error, raised once more at close
            pass


def _stepping(model, opt, n: int) -> None:
    for _ in range(n):
        model(torch.randn(2, 3)).sum().backward()  # forward pre-hook: a boundary
        opt.step()
        opt.zero_grad()


def test_the_target_counts_updates_from_the_request_whatever_the_writers_count(tmp_path):
    # The writer's engine counts updates from the optimizers' step state (a resumed Adam: 8
    # here), this process from its attach (0): the share is taken K-1 = 2 updates after the
    # request, as the writer captures.
    model = torch.nn.Linear(3, 3)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = []
    rank = RankCapture([model], [opt], lambda: taken.append(rank.version) or {}, "random_states_1.pkl")
    rank.follow({"seq": 0, "staging": str(tmp_path), "target": 10, "version": 8, "now": [],
                 "skipped": False})
    _stepping(model, opt, 3)
    assert taken == [2]
    rank.close()


@pytest.mark.parametrize("into", ["model", "optimizer", "part"])
def test_a_load_at_the_request_takes_the_share_there_as_the_writer_does(tmp_path, into):
    # Every process loads at the same point; the writer's engine captures the saves still
    # pending at a load into the whole model or an optimizer, and the ones requested at this
    # very update at a load into a part: so does this process.
    model = torch.nn.Sequential(torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    taken = []
    rank = RankCapture([model], [opt], lambda: taken.append(rank.version) or {}, "random_states_1.pkl",
                       model=model)
    _stepping(model, opt, 1)
    rank.follow({"seq": 0, "staging": str(tmp_path), "target": 3, "version": 1, "now": [],
                 "skipped": False})
    _stepping(model, opt, 1)
    rank.follow({"seq": 1, "staging": str(tmp_path), "target": 4, "version": 2, "now": [],
                 "skipped": False})
    target = {"model": model, "optimizer": opt, "part": model[1]}[into]
    target.load_state_dict(target.state_dict())
    # A restore ends both; a part's load the one requested at this update (2) alone.
    assert taken == ([2, 2] if into != "part" else [2])
    _stepping(model, opt, 2)
    assert taken == ([2, 2] if into != "part" else [2, 3])
    rank.close()
