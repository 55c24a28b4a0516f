"""The trainer config's choices (one ``Literal`` each: a config checks them at load, and modules that
map a choice to an implementation key their mapping by its values, ``keyed_by``) and the ``shape``
mark of the fields that size saved tensors."""
from __future__ import annotations

from dataclasses import field
from typing import Any, Literal

ShardingName = Literal["row_wise", "table_wise"]
ParallelBackendName = Literal["auto", "gloo", "nccl"]
SparseOptimizerName = Literal["adagrad", "sgd", "adam"]
# fbgemm's CPU embedding kernels take exact (row-wise) adagrad and SGD only.
CUDA_ONLY_SPARSE_OPTIMIZERS: tuple[SparseOptimizerName, ...] = ("adam",)
AttentionNormalization = Literal["sample_length", "max_seq_len"]
AttentionActivation = Literal["silu", "softmax"]
HSTUInit = Literal["torch", "reference"]
CommMode = Literal["plain", "overlap", "prioritized"]
AttentionKernelName = Literal["triton", "grouped"]
AttentionKernel = Literal["auto", AttentionKernelName]  # flattens to "auto" | "triton" | "grouped"
LossKind = Literal["sampled_softmax", "bce"]
LearningRateDecay = Literal["constant", "linear", "cosine"]
Precision = Literal["fp32", "bf16"]
CudaGraphs = Literal["off", "encoder"]
# The validation metrics early stopping can follow: the summary's names of the validation item's
# scores (``freescale.training.eval.evaluator``); the sampled ones need ``evaluation.sampled_negatives > 0``.
ValidationMetric = Literal["valid_ndcg_at_10", "valid_hr_at_10", "valid_mrr",
                           "valid_sampled_ndcg_at_10", "valid_sampled_hr_at_10", "valid_sampled_mrr"]


# Field metadata key: the field's value sizes saved tensors (``shape``).
SHAPE = "shape"


def shape(default: Any) -> Any:
    """A config field whose value sizes parameters or optimizer state: a checkpoint cannot be loaded
    into a model built with another value, so a resume that changes it is refused (``shape_keys``).
    Everything else about an encoder (dropout, bucketing, kernels) may change across a resume."""
    return field(default=default, metadata={SHAPE: True})
