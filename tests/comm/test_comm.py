"""The comm layer: its clock, routes, priority groups and bucketed dense sync, and on 2 gloo
ranks the overlapped modes computing exactly what the plain step computes."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from torch import nn

import freescale.comm.clock as clock_module
from freescale.comm.backend import BackendUnavailable, build_backend
from freescale.comm.clock import CommClock, overlap_length, union_length
from freescale.comm.dense_sync import BucketedGradSync
from freescale.comm.exchange import EmbeddingExchange, ExchangedFeature, priority_groups
from freescale.comm.routes import LocalLookup, TableRoute
from tests.helpers import in_process_args, train_in_process

MODES = ("plain", "overlap", "prioritized")


class FakeWork:
    """A transfer that finishes when the test says so (or when waited on, at a given time)."""

    def __init__(self, now: list[float], done_at: float | None = None):
        self.now, self.done_at = now, done_at
        self.callbacks: list = []
        self.done = False

    def complete(self) -> None:
        self.done = True
        for fn in self.callbacks:
            fn()

    def wait(self) -> None:
        if not self.done:
            self.now[0] = max(self.now[0], self.done_at)
            self.complete()

    def is_completed(self) -> bool:
        return self.done

    def on_complete(self, fn) -> None:
        self.callbacks.append(fn)
        if self.done:
            fn()


@pytest.fixture
def fake_time(monkeypatch):
    now = [0.0]
    monkeypatch.setattr(clock_module.time, "perf_counter", lambda: now[0])
    return now


def test_union_and_overlap_lengths_hand_computed():
    intervals = [(0.0, 1.0), (0.5, 2.0), (3.0, 4.0)]
    assert union_length(intervals) == 3.0
    assert union_length([]) == 0.0
    assert overlap_length(intervals, 1.5, 3.5) == 1.0  # [1.5, 2] and [3, 3.5]
    assert overlap_length(intervals, 2.0, 3.0) == 0.0


def test_clock_reports_in_flight_union_and_exposed_waits(fake_time):
    clock = CommClock()
    a = FakeWork(fake_time)
    clock.track("a", a)                        # in flight 0 .. 2
    fake_time[0] = 1.0
    b = FakeWork(fake_time, done_at=5.0)
    tracked_b = clock.track("b", b)            # in flight 1 .. 5, waited 3 .. 5
    fake_time[0] = 2.0
    a.complete()
    fake_time[0] = 3.0
    tracked_b.wait()
    fake_time[0] = 5.5
    c = FakeWork(fake_time)
    clock.track("c", c)                        # still in flight when the step ends at 6
    seen = clock.close_step(0.0, 6.0)
    assert seen.comm_s == pytest.approx(5.5)   # [0, 5] and [5.5, 6]
    assert seen.exposed_comm_s == pytest.approx(2.0)
    assert seen.waits == [(3.0, 5.0)]
    assert clock.step_issue_log == ["a", "b", "c"]
    fake_time[0] = 7.0
    c.complete()
    seen = clock.close_step(6.0, 8.0)          # c carries over: 6 .. 7
    assert seen.comm_s == pytest.approx(1.0)
    assert seen.exposed_comm_s == 0.0
    assert clock.step_issue_log == []


def test_wait_on_a_transfer_finished_in_an_earlier_step_stays_inside_comm(fake_time):
    clock = CommClock()
    work = FakeWork(fake_time)
    tracked = clock.track("x", work)
    fake_time[0] = 1.0
    work.complete()
    clock.close_step(0.0, 2.0)
    fake_time[0] = 3.0
    tracked.wait()                             # returns at once, at 3
    seen = clock.close_step(2.0, 4.0)
    assert 0.0 <= seen.exposed_comm_s <= seen.comm_s


def test_table_route_owner_and_local_row():
    route = TableRoute(starts=torch.tensor([0, 26]), ranks=torch.tensor([0, 1]))
    owner, local = route.owners(torch.tensor([0, 25, 26, 50]))
    assert owner.tolist() == [0, 0, 1, 1]
    assert local.tolist() == [0, 25, 0, 24]
    table_wise = TableRoute(starts=torch.tensor([0]), ranks=torch.tensor([1]))
    owner, local = table_wise.owners(torch.tensor([3, 0, 9]))
    assert owner.tolist() == [1, 1, 1] and local.tolist() == [3, 0, 9]


def test_priority_groups_parse_aliases_and_leftovers():
    features = ["item", "negative", "age", "zip"]
    assert priority_groups("item,user;negative", features, {"user": ["age", "zip"]}) == \
        [["item", "age", "zip"], ["negative"]]
    # Unnamed features join the last group; an empty alias is allowed (no user features).
    assert priority_groups("item;negative", features, {"user": []}) == [["item"], ["negative", "age", "zip"]]
    assert priority_groups("item,user", ["item", "negative"], {"user": []}) == [["item", "negative"]]
    with pytest.raises(ValueError, match="'bogus' is not a feature"):
        priority_groups("item;bogus", features)
    with pytest.raises(ValueError, match="'item' is in two groups"):
        priority_groups("item;item", features)


class RecordingBackend:
    """World of one: all-reduce is the identity; records what was issued, in order."""

    name = "recording"

    def __init__(self):
        self.issued: list[int] = []

    def all_reduce(self, tensor, group):
        self.issued.append(tensor.numel())
        work = FakeWork([0.0])
        work.complete()
        return work


def test_dense_buckets_go_in_order_whatever_order_gradients_arrive():
    params = [nn.Parameter(torch.ones(n)) for n in (1, 2, 3, 4)]
    backend = RecordingBackend()
    sync = BucketedGradSync(params, backend, None, CommClock(), world_size=1, bucket_bytes=1, hold_last=True)
    # One parameter per bucket, in reverse registration order: sizes 4, 3, 2, 1.
    assert [b.params[0].numel() for b in sync.buckets] == [4, 3, 2, 1]
    for p in params:
        p.grad = torch.full_like(p, float(p.numel()))
    sync._grad_ready(params[1])                # bucket 2 first: nothing may go before 0 and 1
    assert backend.issued == []
    sync._grad_ready(params[3])
    assert backend.issued == [4]
    sync._grad_ready(params[2])
    assert backend.issued == [4, 3, 2]
    sync._grad_ready(params[0])                # the last bucket is held back ...
    assert backend.issued == [4, 3, 2]
    sync.release()                             # ... until the embedding gradients are out
    assert backend.issued == [4, 3, 2, 1]
    sync.finish()
    assert [p.grad.tolist() for p in params] == [[1.0], [2.0, 2.0], [3.0] * 3, [4.0] * 4]
    sync.remove_hooks()


def test_dense_sync_issues_zeros_for_gradients_the_backward_did_not_produce():
    used, unused = nn.Parameter(torch.ones(2)), nn.Parameter(torch.ones(3))
    backend = RecordingBackend()
    sync = BucketedGradSync([used, unused], backend, None, CommClock(), world_size=1, bucket_bytes=1)
    (used * 2.0).sum().backward()              # the hook issues bucket 1 only after bucket 0 (unused)
    assert backend.issued == []
    sync.finish()
    assert backend.issued == [3, 2]
    assert unused.grad.tolist() == [0.0, 0.0, 0.0] and used.grad.tolist() == [2.0, 2.0]
    sync.remove_hooks()


class LoopbackBackend(RecordingBackend):
    """World of one over a real gloo group: its work handles hold their tensors in C++, as in a
    training, where Python's cycle collector cannot see them."""

    def __init__(self):
        import torch.distributed as dist
        from datetime import timedelta

        super().__init__()
        self.group = dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=30))

    def all_to_all(self, output, input, output_splits, input_splits, group):
        from freescale.comm.base import TorchWork
        import torch.distributed as dist

        return TorchWork(self.group.alltoall_base(output, input, output_splits, input_splits,
                                                  dist.AllToAllOptions()))


class RowsOf(nn.Module):
    """A local lookup kernel: the rows of its ids (what TorchRec's kernel returns, unpooled)."""

    def __init__(self, rows: int, dim: int):
        super().__init__()
        self.table = nn.Embedding(rows, dim)

    def forward(self, kjt):
        return self.table(kjt.values())


def test_a_steps_exchange_is_freed_once_its_step_is_done():
    """Long runs: every step's exchange (its rows, received rows, gradients and graph) must go
    when the step lets go of it. A gradient hook holding the exchange kept all of them alive
    (~4 MB per step on a 2-rank run): the cycle runs through gloo's work handles, in C++."""
    import gc
    import weakref

    route = TableRoute(starts=torch.tensor([0]), ranks=torch.tensor([0]))
    kernel = RowsOf(10, 4)
    exchange = EmbeddingExchange([ExchangedFeature("item", route, 0), ExchangedFeature("negative", route, 0)],
                                 [LocalLookup(kernel, ("item", "negative"), pooled=False)],
                                 [["item"], ["negative"]], LoopbackBackend(), None, CommClock(), rank=0,
                                 world_size=1, dim=4)
    freed = []
    for _ in range(3):
        step = exchange.start({"item": torch.tensor([3, 1, 3]), "negative": torch.tensor([7, 2])})
        step.send_ids()
        step.look_up()
        items, negatives = step.feature("item"), step.feature("negative")
        assert torch.equal(items, kernel.table.weight[[3, 1, 3]])
        (items.sum() + 2 * negatives.sum()).backward()
        step.finish_backward()
        freed.append(weakref.ref(step))
        del step, items, negatives
    gc.collect()
    assert [ref() for ref in freed] == [None, None, None]
    assert kernel.table.weight.grad[3].tolist() == [6.0] * 4  # id 3 twice per step, 3 steps


@pytest.mark.parametrize("name", ["nccl", "copy_engine", "infiniband"])
def test_unavailable_backend_is_one_line(name):
    if name != "infiniband" and torch.cuda.is_available():
        pytest.skip("a CUDA machine has these backends")
    from datetime import timedelta

    with pytest.raises(BackendUnavailable) as info:
        build_backend(name, timedelta(seconds=10))
    assert "\n" not in str(info.value) and name in str(info.value)


# ------------------------------------------------------------- 2 gloo ranks


def _column(log: dict, name: str) -> np.ndarray:
    table = np.array(log["timings"]["steps_ranks_fields"])
    return table[..., log["timings"]["fields"].index(name)]


def _check_timings(mode: str, log: dict) -> None:
    comm, exposed, step = (_column(log, name) for name in ("comm_s", "exposed_comm_s", "step_s"))
    assert (exposed >= 0).all() and (exposed <= comm).all() and (comm <= step).all(), mode
    if mode == "plain":
        assert (exposed == comm).all()
    else:  # collectives were in flight while the thread computed
        assert exposed.sum() < comm.sum()
        assert log["summary"]["overlap_fraction"] > 0


@pytest.mark.slow
@pytest.mark.e2e  # its scenarios come through request.getfixturevalue, which marks nothing
@pytest.mark.parametrize("sharding", ["row_wise", "table_wise"])
def test_overlapped_modes_compute_what_plain_computes(sharding, request):
    """The same shards and seed, with user features, in each mode (the session's runs): the losses
    agree step for step, to the last bit, the measured times nest, and the collectives go out in
    priority order.
    Row-wise: prioritized (8 steps), plain (the steps a stopped run recorded in MLflow), overlap
    (resumed from that run's step 3). Table-wise: overlap (8 steps), prioritized (the steps recorded
    before one of its ranks was killed), plain (the first 8 steps of restarted_run's uninterrupted run)."""
    if sharding == "row_wise":
        row, stopped, resumed = (request.getfixturevalue(name) for name in ("row_run", "stopped_run", "row_resume"))
        reference = row.log["losses"]
        plain = [loss for step, loss in stopped.logged if step < len(reference)]
        assert len(plain) >= 3 and plain == reference[:len(plain)]
        assert resumed.log["losses"] == reference[3:]
        logs = {"prioritized": row.log, "overlap": resumed.log}
    else:
        table, killed, restarted = (request.getfixturevalue(name)
                                    for name in ("table_run", "killed_run", "restarted_run"))
        reference = table.log["losses"]
        assert len(killed.logged) >= 2 and killed.logged == list(enumerate(reference))[:len(killed.logged)]
        plain = restarted.stopped.log
        assert plain["losses"][:len(reference)] == reference
        logs = {"overlap": table.log, "plain": plain}
    assert len(reference) == 8
    for mode, log in logs.items():
        assert log["comm"].startswith(f"comm mode {mode}")
        _check_timings(mode, log)
    if "prioritized" in logs:
        order = logs["prioritized"]["comm_issue_order"]
        first, last = "embeddings[item,age,gender,occupation,zip_code]", "embeddings[negative]"
        assert order.index(first) < order.index(last)
        # The next step's ids leave during this step, before its gradients come back.
        assert order.index("ids_counts") < order.index("ids") < order.index("embedding_grads[negative]")
        # Gradients go back lowest priority first, and ahead of the last dense bucket.
        grads = order.index("embedding_grads[item,age,gender,occupation,zip_code]")
        assert order.index("embedding_grads[negative]") < grads
        dense = [i for i, name in enumerate(order) if name.startswith("dense_allreduce")]
        assert dense and grads < dense[-1]
    assert "embeddings[item,negative,age,gender,occupation,zip_code]" in logs["overlap"]["comm_issue_order"]
    if "plain" in logs:
        assert logs["plain"]["comm_issue_order"] == []


def test_copy_engine_backend_without_a_gpu_is_one_line(movielens_shards_1, capsys):
    """One rank, in process: an environment problem (exit 3, freescale/runtime/job_errors.py) in one line."""
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    assert train_in_process(*in_process_args(movielens_shards_1, "--training.max_steps", "2",
                                             "--comm.backend", "copy_engine")) == 3
    lines = capsys.readouterr().err.strip().splitlines()
    assert lines[-1].startswith("freescale train (rank 0): error: comm.backend copy_engine needs CUDA"), lines


def test_idle_and_overlap_fractions_hand_computed():
    from freescale.training.timing.bubbles import idle_fraction, overlap_fraction

    compute = np.array([[6.0, 8.0], [4.0, 4.0]])   # [steps, ranks]
    step_time = np.array([10.0, 5.0])               # rank-time 2 x 15 = 30, compute 22
    assert idle_fraction(compute, step_time) == pytest.approx(8.0 / 30.0)
    exposed = np.array([[1.0, 2.0], [0.0, 0.0]])
    assert idle_fraction(exposed, step_time, share=True) == pytest.approx(3.0 / 30.0)
    comm = np.array([[4.0, 4.0], [2.0, 2.0]])
    assert overlap_fraction(comm, exposed) == pytest.approx(1.0 - 3.0 / 12.0)
    assert overlap_fraction(np.zeros((1, 2)), np.zeros((1, 2))) == 0.0
