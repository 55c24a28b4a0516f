"""Trainer configuration: typed dataclasses, loaded from TOML, overridden from the command line.

Plain dataclasses that import nothing from the model (so jobs can read a config without
loading torch). Every choice is a ``Literal`` checked when the config loads: a bad value
stops the run with one line naming the key and the allowed values, before any rank starts
work. Modules that map a choice to an implementation key their mapping by the Literal's
values (``keyed_by`` checks at import that the two agree). Keys and values are checked by the
one typed-config engine, ``freescale.runtime.typed_config``, as the pipeline's config and every
job's command line are.

    [training]
    max_steps = 100
    [model.hstu]
    num_layers = 2

    torchrun ... -m freescale.jobs.train --config configs/ml100k.toml --training.max_steps 20 --data.shards out/s

choices.py: the Literal choices and the ``shape`` mark; model.py: ``[model]`` and its encoders'
sections; sections.py: the other sections and ``TrainConfig``; loading.py: files, overrides, moved
keys and the keys checkpoints depend on.
"""
from __future__ import annotations

from freescale.runtime.typed_config import ConfigError, OneOf, apply_table, keyed_by, parse_overrides, to_flat_dict
from freescale.training.config.choices import (CUDA_ONLY_SPARSE_OPTIMIZERS, SHAPE, AttentionActivation, AttentionKernel,
                                               AttentionKernelName, AttentionNormalization, CommMode, CudaGraphs,
                                               HSTUInit, LearningRateDecay, LossKind, ParallelBackendName, Precision,
                                               ShardingName, SparseOptimizerName, ValidationMetric, shape)
from freescale.training.config.loading import MOVED_KEYS, load_config, moved_flat, shape_keys
from freescale.training.config.model import (ENCODERS, EncoderName, HSTUConfig, ModelConfig, SASRecConfig,
                                             declare_encoder_section)
from freescale.training.config.sections import (CheckpointConfig, CommConfig, DataConfig, EvaluationConfig, LossConfig,
                                                OptimizerConfig, ParallelConfig, TrackingConfig, TrainConfig,
                                                TrainingConfig)

__all__ = ["CUDA_ONLY_SPARSE_OPTIMIZERS", "ENCODERS", "MOVED_KEYS", "SHAPE", "AttentionActivation", "AttentionKernel",
           "AttentionKernelName", "AttentionNormalization", "CheckpointConfig", "CommConfig", "CommMode", "ConfigError",
           "CudaGraphs", "DataConfig", "EncoderName", "EvaluationConfig", "HSTUConfig", "HSTUInit", "LearningRateDecay",
           "LossConfig", "LossKind", "ModelConfig", "OneOf", "OptimizerConfig", "ParallelBackendName", "ParallelConfig",
           "Precision", "SASRecConfig", "ShardingName", "SparseOptimizerName", "TrackingConfig", "TrainConfig",
           "TrainingConfig", "ValidationMetric", "apply_table", "declare_encoder_section", "keyed_by", "load_config",
           "moved_flat", "parse_overrides", "shape", "shape_keys", "to_flat_dict"]
