"""The prepare job's Spark work over a ``PrepareSpec``: raw interactions (or the seeded generator)
and an optional user table -> the prepared-data format (freescale/prepare/prepared.py). freescale/jobs/prepare.py
checks, opens the run, calls :func:`read_inputs` and, inside its atomic output, :func:`write_prepared`,
and reports. pyspark is imported inside the functions.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from freescale.runtime.errors import InputError
from freescale.prepare.prepare_spec import PrepareSpec
from freescale.prepare.prepared import HISTORY_DIR, METADATA_NAME, PREPARE_FORMAT, SEQUENCES_DIR, metadata_text

if TYPE_CHECKING:
    from pyspark.sql import DataFrame


def check_local_inputs(spec: PrepareSpec) -> None:
    """Local inputs before Spark starts (remote ones are Spark's to check): they exist, their Parquet
    footers are readable and have the needed columns."""
    from freescale.prepare import preflight

    if spec.input is not None:
        preflight.check_interactions(spec.input, spec.format, user_col=spec.user_col, item_col=spec.item_col,
                                     time_col=spec.time_col, rating_col=spec.rating_col)
    if spec.user_features is not None:
        preflight.check_user_table(spec.user_features, spec.feature_columns)


@dataclass
class Inputs:
    """The job's inputs, read once (checkpointed)."""

    source: dict[str, Any]
    """Where the interactions came from, as prepare.json records it."""
    interactions: DataFrame
    counts: dict[str, int]
    users: DataFrame | None = None
    feature_names: list[str] = field(default_factory=list)


def read_inputs(spark, fs, spec: PrepareSpec) -> Inputs:
    """The interactions (read, or generated), the user table when given, and the input's counts."""
    from pyspark.sql import functions as F

    from freescale.prepare.ingest import read_interactions
    from freescale.runtime.session import checkpoint
    from freescale.prepare.synthetic import synthetic_interactions
    from freescale.prepare.user_features import read_user_table

    if spec.input is None:
        source = spec.synthetic_source
        interactions = synthetic_interactions(spark, spec.synthetic_users, spec.synthetic_items, seed=spec.seed,
                                              taste_groups=spec.synthetic_groups,
                                              taste_share=spec.synthetic_group_share)
    else:
        source = {"kind": "file", "uri": fs.qualify(spec.input), "format": spec.format}
        interactions = read_interactions(spark, spec.input, fmt=spec.format, user_col=spec.user_col,
                                         item_col=spec.item_col, time_col=spec.time_col, rating_col=spec.rating_col)
    interactions = checkpoint(interactions)  # read the raw input once
    users, feature_names = None, []
    if spec.user_features is not None:
        # The user table's user column is recognised by name (user_id, userId, ...):
        # --user-col names the interaction log's, which may differ.
        users, feature_names = read_user_table(spark, spec.user_features, feature_cols=spec.feature_columns)
        users = checkpoint(users)
        source["user_features"] = fs.qualify(spec.user_features)
    counts = interactions.agg(F.count(F.lit(1)).alias("interactions"),
                              F.countDistinct("user_id").alias("users")).first().asDict()
    return Inputs(source, interactions, counts, users, feature_names)


@dataclass
class Prepared:
    """What was written: prepare.json's content, its statistics, and the duplicates found."""

    meta: dict[str, Any]
    stats: dict[str, Any]
    repeated: int
    """Repeated (user, item, timestamp) rows in the input."""
    duplicates: int
    """Of those, the ones dropped (none with --keep-duplicates)."""


def write_prepared(spark, fs, staging: str, spec: PrepareSpec, inputs: Inputs) -> Prepared:
    """The vocabularies, the users' states, the sequences and prepare.json under ``staging``."""
    from pyspark.sql import Observation

    from freescale.prepare.ingest import drop_duplicate_interactions
    from freescale.runtime.session import checkpoint
    from freescale.prepare.user_features import build_user_feature_vocab

    feature_vocab = None
    if inputs.users is not None:
        build_user_feature_vocab(inputs.users, inputs.feature_names).write.parquet(f"{staging}/user_feature_vocab")
        feature_vocab = spark.read.parquet(f"{staging}/user_feature_vocab")

    # Duplicates are counted inside the per-user aggregation of the states' write
    # (no pass of their own). A clean input (the usual case) is done; otherwise the
    # vocabulary counts and the states are rebuilt from the deduplicated rows.
    interactions = inputs.interactions
    observed = Observation("repeated interactions")
    vocab, states = _write_states(spark, staging, spec, inputs, feature_vocab, interactions, observed)
    repeated = observed.get["repeated"]
    duplicates = 0 if spec.keep_duplicates else repeated
    if duplicates:
        interactions = checkpoint(drop_duplicate_interactions(interactions))
        vocab, states = _write_states(spark, staging, spec, inputs, feature_vocab, interactions,
                                      mode="overwrite")
    sequences = write_sequences(spark, staging, states, spec.max_seq_len)
    stats = {"input_interactions": inputs.counts["interactions"], "input_users": inputs.counts["users"],
             "duplicates_dropped": duplicates, **output_stats(vocab, states, sequences, inputs.users)}
    meta = finish_metadata(fs, staging, spec, inputs.source, stats, feature_vocab, inputs.feature_names)
    return Prepared(meta, stats, repeated, duplicates)


def output_stats(vocab: DataFrame, states: DataFrame, sequences: DataFrame, users: DataFrame | None) -> dict:
    """prepare.json's counts of what was written: items, sequences (``sequence_stats``), the short
    users left out, and the sequences whose user has no row in the user table (with one)."""
    from freescale.prepare.sequences import sequence_stats, short_user_stats
    from freescale.prepare.user_features import count_users_without_features

    stats = {"num_items": vocab.count(), **sequence_stats(sequences), **short_user_stats(states)}
    if users is not None:
        stats["users_without_features"] = count_users_without_features(sequences, users)
    return stats


def finish_metadata(fs, staging: str, spec: PrepareSpec, source: dict, stats: dict, feature_vocab,
                    feature_names: list[str], extra: dict | None = None) -> dict[str, Any]:
    """prepare.json's content, written last (``extra``: keys after the usual ones); a user-less
    output is refused instead."""
    from freescale.prepare.user_features import feature_cardinalities

    if stats["users"] == 0:
        raise InputError(f"input {source.get('uri', 'synthetic')}: no user has the 3 interactions "
                         "a leave-one-out split needs")
    feature_meta = {"user_features": feature_cardinalities(feature_vocab, feature_names)} if feature_names else {}
    meta = {"format": PREPARE_FORMAT, "source": source, "max_seq_len": spec.max_seq_len, **stats, **feature_meta,
            **(extra or {})}
    fs.write_text(f"{staging}/{METADATA_NAME}", metadata_text(meta))
    return meta


def _write_states(spark, staging: str, spec: PrepareSpec, inputs: Inputs, feature_vocab, interactions,
                  repeated=None, mode: str = "errorifexists") -> tuple[DataFrame, DataFrame]:
    """The item vocabulary and the users' states (``history/``) of ``interactions``, written and
    read back."""
    from freescale.prepare.sequences import apply_item_vocab, build_item_vocab, events_per_user, user_states
    from freescale.prepare.user_features import encode_user_features

    vocab = build_item_vocab(interactions)
    vocab.write.mode(mode).parquet(f"{staging}/item_vocab")
    vocab = spark.read.parquet(f"{staging}/item_vocab")
    states = user_states(events_per_user(apply_item_vocab(interactions, vocab), repeated), spec.max_seq_len)
    if inputs.users is not None:
        states = encode_user_features(states, inputs.users, feature_vocab, inputs.feature_names)
    states.write.mode(mode).parquet(f"{staging}/{HISTORY_DIR}")
    return vocab, spark.read.parquet(f"{staging}/{HISTORY_DIR}")


def write_sequences(spark, staging: str, states: DataFrame, max_seq_len: int) -> DataFrame:
    """The sequences of ``states``' users, written under ``staging`` and read back."""
    from freescale.prepare.sequences import states_to_sequences

    states_to_sequences(states, max_seq_len).write.parquet(f"{staging}/{SEQUENCES_DIR}")
    return spark.read.parquet(f"{staging}/{SEQUENCES_DIR}")
