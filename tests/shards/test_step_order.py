"""epoch_order: the order in which an epoch visits the plan's steps."""
from __future__ import annotations

import numpy as np
import pytest

from freescale.shards.step_order import epoch_order


@pytest.mark.parametrize("num_steps", [0, 1, 7, 30])
def test_epoch_zero_is_the_plan_order(num_steps: int) -> None:
    for window in (1, 4):
        assert epoch_order(num_steps, window, 3, 0).tolist() == list(range(num_steps))


@pytest.mark.parametrize("window", [1, 3, 4])
def test_each_later_epoch_is_a_deterministic_permutation(window: int) -> None:
    orders = [epoch_order(30, window, 7, epoch) for epoch in range(1, 6)]
    for epoch, order in enumerate(orders, start=1):
        assert order.dtype == np.int64 and sorted(order.tolist()) == list(range(30))
        assert np.array_equal(order, epoch_order(30, window, 7, epoch))  # same arguments, same order
    # epochs differ from the plan and from each other; another seed gives other orders
    assert all(not np.array_equal(o, np.arange(30)) for o in orders)
    assert len({tuple(o.tolist()) for o in orders}) == len(orders)
    assert not np.array_equal(orders[0], epoch_order(30, window, 8, 1))


@pytest.mark.parametrize("num_steps,window", [(30, 3), (31, 4), (5, 5), (6, 10)])
def test_windows_stay_whole_and_in_their_own_order(num_steps: int, window: int) -> None:
    for epoch in range(1, 4):
        order = epoch_order(num_steps, window, 1, epoch).tolist()
        # a window is its plan steps in order; only the last window of the plan may be short
        pieces, start = [], 0
        while start < len(order):
            first = order[start]
            size = min(window, num_steps - first)
            assert first % window == 0 and order[start:start + size] == list(range(first, first + size))
            pieces.append(first // window)
            start += size
        assert sorted(pieces) == list(range(-(-num_steps // window)))


def test_a_negative_seed_is_its_own_order() -> None:
    assert not np.array_equal(epoch_order(40, 1, -3, 1), epoch_order(40, 1, 3, 1))
    assert sorted(epoch_order(40, 1, -3, 1).tolist()) == list(range(40))


def test_epochs_before_permuted_from_keep_the_plan_order() -> None:
    assert epoch_order(9, 1, 2, 3, permuted_from=4).tolist() == list(range(9))
    assert np.array_equal(epoch_order(9, 1, 2, 4, permuted_from=4), epoch_order(9, 1, 2, 4))


@pytest.mark.parametrize("args", [(-1, 1, 0, 1), (5, 0, 0, 1), (5, 1, 0, -1)])
def test_bad_arguments_are_refused(args: tuple[int, int, int, int]) -> None:
    with pytest.raises(ValueError, match="epoch_order"):
        epoch_order(*args)
    with pytest.raises(ValueError, match="permuted_from 0"):
        epoch_order(5, 1, 0, 1, permuted_from=0)


def test_the_order_is_pinned() -> None:
    """A checkpoint's position means these exact orders: a change here would misplace every resume of a
    later epoch (the keys come from SeedSequence's hash, a fixed algorithm)."""
    assert epoch_order(8, 1, 0, 1).tolist() == [7, 3, 1, 2, 5, 0, 6, 4]
    assert epoch_order(10, 3, 0, 1).tolist() == [9, 3, 4, 5, 6, 7, 8, 0, 1, 2]
