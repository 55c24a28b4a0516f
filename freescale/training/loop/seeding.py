"""Every random number a run draws, as a function of the seed (and the rank and step where they differ).

* The initial weights: one seed on every rank, so the dense part starts equal
  (rank 0's is broadcast anyway) and a table shard does not depend on which rank
  materialises it.
* Dropout (the global torch RNG) and the in-batch negative cap (``rank_generator``):
  per rank; both states are in the rank's checkpoint, so a resume replays them.
* The uniform negatives of step ``s`` (``StepNegatives``): a function of (seed,
  rank, s) alone -- and, under ``loss.kind = "bce"`` (one per position), of the
  count of the step's positions -- so every comm mode -- which may draw them a step
  early -- and a resumed run use the same ones.
"""
from __future__ import annotations

import numpy as np
import torch

from freescale.training.data.batch import SequenceBatch
from freescale.training.config import LossConfig
from freescale.training.model.recommender import SequentialRecommender


def seed_initial_weights(seed: int) -> None:
    """Before the model is built and sharded: its initialisation draws from the global RNG."""
    torch.manual_seed(seed)


def rank_generator(seed: int, rank: int) -> torch.Generator:
    """Seeds the global RNG (dropout) for this rank and returns the rank's own generator."""
    rank_seed = seed * 1_000_003 + rank
    torch.manual_seed(rank_seed)
    return torch.Generator().manual_seed(rank_seed)


class StepNegatives:
    """``negatives(step, batch)``: this rank's uniform negatives of that step (the catalog under
    full softmax); ``batch`` (this rank's batch of the step) only sets their count under bce."""

    def __init__(self, model: SequentialRecommender, loss: LossConfig, seed: int, rank: int, device: torch.device):
        self.model, self.loss, self.seed, self.rank, self.device = model, loss, seed, rank, device

    def __call__(self, step: int, batch: SequenceBatch) -> torch.Tensor:
        if self.loss.full_softmax:
            return torch.arange(1, self.model.num_items + 1, device=self.device)
        state = np.random.SeedSequence([self.seed, self.rank, step]).generate_state(2)
        generator = torch.Generator().manual_seed(int(state[0]) << 32 | int(state[1]))
        count = self.model.negative_count(self.loss.kind, self.loss.num_negatives, batch.num_tokens)
        return self.model.sample_negatives(count, torch.device("cpu"), generator).to(self.device)
