"""The jagged batch every trainer component passes around: one rank's samples of one step."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch

from freescale.training.ops.jagged import offsets_from_lengths

if TYPE_CHECKING:  # TorchRec loads with the first lookup: a model without its tables never needs it
    from torchrec import KeyedJaggedTensor

ITEM_FEATURE = "item"
NEGATIVE_FEATURE = "negative"
FEATURE_KEYS = [ITEM_FEATURE, NEGATIVE_FEATURE]


TENSOR_FIELDS = ("lengths", "item_ids", "timestamps", "ratings", "valid_item", "test_item", "valid_timestamp",
                 "test_timestamp", "valid_rating", "user_features")
"""The batch's tensors (some optional): what ``to`` moves and ``concat`` joins."""


@dataclass
class SequenceBatch:
    """A jagged batch of user histories with leave-one-out evaluation targets.

    Sample ``i``'s history is ``item_ids[offsets[i]:offsets[i+1]]`` (same for
    ``timestamps`` and ``ratings``), with ``offsets`` the running sum of ``lengths``.
    """

    lengths: torch.Tensor
    """``[B]`` int64 history length of each sample."""
    item_ids: torch.Tensor
    """``[T]`` int64 item ids of all histories concatenated (``T = lengths.sum()``), in 1..num_items."""
    timestamps: torch.Tensor
    """``[T]`` int64 interaction time, seconds."""
    ratings: torch.Tensor
    """``[T]`` int64 rating 1..5, 0 when unknown."""
    valid_item: torch.Tensor
    """``[B]`` int64 validation target (the interaction after the history)."""
    test_item: torch.Tensor
    """``[B]`` int64 test target (the interaction after the validation item)."""
    valid_timestamp: torch.Tensor
    """``[B]`` int64 time of the validation interaction."""
    test_timestamp: torch.Tensor
    """``[B]`` int64 time of the test interaction."""
    user_ids: list[str]
    """``B`` user ids, for logging and debugging only."""
    step: int = 0
    """The plan step this batch belongs to (the shards' ``step``; the run's step differs after the
    first epoch, whose order is the plan's)."""
    step_targets: int = 0
    """Next-item targets of this step summed over all ranks (from the shards). The loss
    is divided by it, so a target weighs the same whichever rank the plan put it on."""
    cost: float = 0.0
    """Sum of the cost model over the batch's samples: what the plan expected this rank to do."""
    valid_rating: torch.Tensor | None = None
    """Optional ``[B]`` int64 rating of the validation item; used as the rating of the
    appended position in test scoring. ``None`` means unknown (0)."""
    user_features: torch.Tensor | None = None
    """Optional ``[B, F]`` int64 id of each of the ``F`` user features (0 = unknown), in
    the manifest's ``user_features`` order. ``None`` when the data has none."""
    targets_counted: int | None = None
    """``num_targets`` as counted on the host when the batch left it (``to``); None: not yet."""

    @property
    def batch_size(self) -> int:
        return int(self.lengths.numel())

    @property
    def num_tokens(self) -> int:
        return int(self.item_ids.numel())

    @property
    def num_targets(self) -> int:
        """Next-item targets of this batch, ``sum max(L - 1, 0)``: counted where ``lengths`` were on the
        host, so a GPU step never reads it back (``freescale.training.ops.jagged.next_item_positions``)."""
        if self.targets_counted is not None:
            return self.targets_counted
        return int((self.lengths - 1).clamp(min=0).sum())

    @property
    def offsets(self) -> torch.Tensor:
        """``[B+1]`` int64 start of each sample in the jagged tensors."""
        return offsets_from_lengths(self.lengths)

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "SequenceBatch":
        """Copy of the batch with every tensor on ``device``."""
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device, non_blocking=non_blocking)

        counted = self.num_targets if self.lengths.device.type == "cpu" else self.targets_counted
        return replace(self, **{name: move(getattr(self, name)) for name in TENSOR_FIELDS}, targets_counted=counted)

    @classmethod
    def concat(cls, batches: list["SequenceBatch"]) -> "SequenceBatch":
        """The samples of ``batches``, in order, as one batch (step, step_targets and cost the
        first's, for scoring only: evaluation batches several steps' samples at once)."""
        if len(batches) == 1:
            return batches[0]
        first = batches[0]

        def joined(name: str) -> torch.Tensor | None:
            values = [getattr(b, name) for b in batches]
            return None if values[0] is None else torch.cat(values)

        counted = [b.targets_counted for b in batches]
        return replace(first, **{name: joined(name) for name in TENSOR_FIELDS},
                       user_ids=[user for b in batches for user in b.user_ids],
                       targets_counted=None if None in counted else sum(counted))

    def features(self, negatives: torch.Tensor) -> KeyedJaggedTensor:
        """KJT with keys ``["item", "negative"]`` for the item table.

        ``item`` holds the histories; ``negative`` the sampled negative ids.
        """
        return item_features(self.lengths, self.item_ids, negatives)


def user_feature_kjt(names: list[str], user_features: torch.Tensor) -> KeyedJaggedTensor:
    """KJT with one id per sample for each user feature (keys ``names``), for the
    user ``EmbeddingBagCollection``. An empty batch keeps one empty slot, as in
    :func:`item_features`, so every rank still joins the sharded lookup."""
    from torchrec import KeyedJaggedTensor

    batch_size, width = user_features.shape
    if width != len(names):
        raise ValueError(f"user_features has {width} columns for {len(names)} features {names}")
    slots = max(batch_size, 1)
    lengths = torch.ones(width, slots, dtype=torch.int64, device=user_features.device)
    if batch_size == 0:
        lengths.zero_()
    return KeyedJaggedTensor(keys=list(names), values=user_features.to(torch.int64).t().reshape(-1),
                             lengths=lengths.reshape(-1))


def item_features(lengths: torch.Tensor, item_ids: torch.Tensor, negatives: torch.Tensor) -> KeyedJaggedTensor:
    """KJT with keys ``["item", "negative"]``; both features share the batch size ``B``.

    A KJT needs the same number of slots per key, but negatives are shared by
    the whole batch, not per sample; they are spread evenly over the ``B``
    slots (which slot holds which negative does not matter to the loss), which
    keeps the per-slot lengths -- and row-wise all-to-all splits -- balanced.
    """
    from torchrec import KeyedJaggedTensor

    batch_size = max(int(lengths.numel()), 1)
    if lengths.numel() == 0:
        lengths = torch.zeros(1, dtype=torch.int64, device=item_ids.device)
    num_negatives = int(negatives.numel())
    negative_lengths = torch.full((batch_size,), num_negatives // batch_size, dtype=torch.int64, device=item_ids.device)
    negative_lengths[: num_negatives % batch_size] += 1
    return KeyedJaggedTensor(
        keys=FEATURE_KEYS,
        values=torch.cat([item_ids.to(torch.int64), negatives.to(torch.int64)]),
        lengths=torch.cat([lengths.to(torch.int64), negative_lengths]),
    )
