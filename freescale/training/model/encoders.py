"""The encoder contract: what the model asks of a sequence encoder (``freescale.training.model.registry`` builds one).

An encoder maps a jagged batch's input rows to output rows of the same width, one per position::

    hidden = encoder(values [T, D], offsets [B+1] int64, timestamps [T] seconds) -> [T, D]

``D`` is the model's width (``model.embedding_dim``); ``values`` are the item rows of every
position, samples back to back, with the model's rating and user feature rows added and scaled by
``sqrt(D)``. Every encoder keeps the same promises, which the trainer, the balancer and the
evaluation rely on:

* **causal within a sample**: position ``t``'s output depends on positions ``0..t`` of its own
  sample only, never on its batch-mates, so a query scored at evaluation encodes as a training
  query of the same history did, and a plan's choice of batch changes no output;
* **unpadded**: a batch's work is the sum of its samples' own (``a L^2 + b L + c`` each), the
  balancer's cost model. ``freescale.training.ops.jagged.GroupedPlan`` runs per-sample work per group of
  equal-length samples without padding;
* **L2-normalised outputs**: every score is a cosine similarity against normalised item rows.

Which config fields size its parameters is marked on its config class (``freescale.training.config.shape``),
so checkpoints refuse a resume that changes one; ``max_seq_len`` is the longest history it is shaped
for. Encoders are registered by name (``freescale.training.model.registry``, ``register_encoder``): the
config class of their section ``[model.<name>]`` and a builder. ``docs/extending.md`` adds one.
"""
from __future__ import annotations

import abc

import torch
from torch import nn



class Encoder(nn.Module, metaclass=abc.ABCMeta):
    """A sequence encoder over jagged batches (the contract above); built by
    ``freescale.training.model.registry.build_encoder``."""

    @abc.abstractmethod
    def forward(self, values: torch.Tensor, offsets: torch.Tensor, timestamps: torch.Tensor) -> torch.Tensor:
        """``[T, D]`` L2-normalised outputs, one per row of ``values``, in the same (jagged) order."""

    @property
    @abc.abstractmethod
    def max_seq_len(self) -> int:
        """The longest history this encoder is shaped for (its config's ``max_seq_len``)."""

    def kernel(self, device: torch.device | str) -> str:
        """How this encoder's per-sample work runs on ``device``, as ``freescale calibrate`` records it;
        raises where it cannot run there, so the model's construction stops the job. Default:
        ``"grouped"``, PyTorch ops per group of equal-length samples (``freescale.training.ops.jagged.GroupedPlan``)."""
        return "grouped"

    def not_capturable(self, device: torch.device | str) -> str | None:
        """Why a CUDA graph cannot capture this encoder's forward and backward on ``device``
        (``training.cuda_graphs``); None when it can. A graph replays fixed kernels, so nothing may read
        the batch on the host. Default: the grouped work does (its groups are the lengths)."""
        return "its grouped work reads the batch's lengths on the host"


def feed_forward_network(width: int, hidden: int, dropout: float) -> nn.Sequential:
    """The point-wise feed-forward network of a Transformer block, ``ReLU(x W1 + b1) W2 + b2`` with
    dropout on the hidden rows (SASRec's; HSTU's optional one is the same network)."""
    return nn.Sequential(nn.Linear(width, hidden), nn.ReLU(), nn.Dropout(dropout), nn.Linear(hidden, width))
