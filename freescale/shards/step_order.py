"""The order in which an epoch visits the plan's steps (torch-free: the trainer's loader and the
launcher side share it).

The balance job fixed which samples every rank trains on at every plan step. Epoch 0 visits the
steps in the plan's own order (the job already placed the samples at random); every later epoch
visits them in a permutation seeded by (the training seed, the epoch), the same on every rank, so
each step keeps the balance its plan gave it and every epoch trains the same samples in another
order. A plan made over windows of ``window_steps`` steps is permuted window by window, each window
kept whole and in its own order: the window planner moved samples between the steps of a window
(each step is still split over the ranks on its own, ``freescale.balancing.window``), and keeping a window
together keeps the plan exactly as made.

A run interrupted at ``position`` of ``epoch`` (its loader state, ``freescale.training.data.shard_reader``:
``epoch``, ``position``, ``order_seed``, ``permuted_from``) has trained the plan steps
``epoch_order(num_steps, window_steps, order_seed, epoch, permuted_from=permuted_from)[:position]``
of that epoch.
"""
from __future__ import annotations

import numpy as np

ORDER_STREAM = 0x5E9_0DE5
"""Mixed into the seed so the order's draws are not those of another use of the training seed."""


def epoch_order(num_steps: int, window_steps: int, seed: int, epoch: int, *, permuted_from: int = 1) -> np.ndarray:
    """Position in ``epoch`` -> the plan step trained there (int64, a permutation of
    ``0..num_steps-1``); the identity for epoch 0. Deterministic in its arguments.

    ``permuted_from``: the first epoch in a permuted order (a loader state's ``permuted_from``;
    1 but for a run resumed from a checkpoint saved before epochs had orders, whose interrupted
    epoch finishes in plan order, as it began)."""
    if num_steps < 0 or window_steps < 1 or epoch < 0 or permuted_from < 1:
        raise ValueError(f"epoch_order: num_steps {num_steps} must be >= 0, window_steps {window_steps} >= 1, "
                         f"epoch {epoch} >= 0, permuted_from {permuted_from} >= 1")
    if epoch < permuted_from:
        return np.arange(num_steps, dtype=np.int64)
    # The windows sorted by keys from SeedSequence's hash (a fixed algorithm, unlike a Generator's
    # methods, which NumPy may change between versions: a resume after an upgrade keeps its order).
    # SeedSequence takes non-negative words: the seed's sign is a word of its own.
    num_windows = -(-num_steps // window_steps)
    keys = np.random.SeedSequence([ORDER_STREAM, abs(int(seed)), int(seed < 0), int(epoch)]).generate_state(
        num_windows, dtype=np.uint64)
    starts = np.argsort(keys, kind="stable").astype(np.int64) * window_steps
    steps = (starts[:, None] + np.arange(window_steps, dtype=np.int64)).ravel()
    return steps[steps < num_steps]  # the last window may be short
