"""Item vocabulary and per-user leave-one-out sequences, all inside Spark.

Split (as in SASRec/BERT4Rec/HSTU evaluations): each user's interactions in
chronological order; the last item is the test target, the second-to-last the
validation target, and everything before is the training sequence, truncated
to the most recent ``max_seq_len`` items. Users with fewer than
``MIN_INTERACTIONS`` (3) interactions cannot be split and are dropped;
``dropped_short_users`` lists them and ``sequence_stats`` counts them, so no
user disappears unaccounted.

Output schema (``SEQUENCE_COLUMNS`` order)::

    user_id: string, items: array<int>, timestamps: array<long>,
    ratings: array<float>, length: int (= size(items)),
    valid_item: int, valid_timestamp: long, valid_rating: float (null when unknown),
    test_item: int, test_timestamp: long,
    num_interactions: int (before the split and truncation)

``ratings`` is always aligned with ``items`` (same length); where the source had
no rating the element is null, so a dataset without ratings gives arrays of nulls.

The sequences are a function of each user's *state* (``STATE_COLUMNS``: the last
``max_seq_len + 2`` events and the event count, :func:`user_states`), short users
included: the prepare job writes the states as ``history/`` and derives the
sequences from them (:func:`states_to_sequences`), and ``prepare --previous``
extends yesterday's states with today's events (freescale/prepare/incremental.py).
"""
from __future__ import annotations

from pyspark.sql import Column, DataFrame, Observation, Window
from pyspark.sql import functions as F

from freescale.runtime.errors import InputError

MIN_INTERACTIONS = 3  # train >= 1 item, plus the validation and test targets

STATE_COLUMNS = ("user_id", "events", "num_interactions")
"""A user's state: ``events`` (``(timestamp, item_id, rating)`` structs, chronological) holds the
last ``max_seq_len + 2`` of the user's ``num_interactions`` events: the most a sequence keeps."""

SEQUENCE_COLUMNS = (
    "user_id", "items", "timestamps", "ratings", "length",
    "valid_item", "valid_timestamp", "valid_rating", "test_item", "test_timestamp", "num_interactions",
)

# Vocabulary ranks are computed per (count, item-name prefix) bucket. A prefix
# of a string orders the same way as the string itself, so buckets ordered by
# (count desc, prefix asc) with offsets add up to the global rank, and the big
# "seen once" group is split across tasks instead of sorted on one partition.
_VOCAB_PREFIX_CHARS = 2


def build_item_vocab(interactions: DataFrame) -> DataFrame:
    """``raw_item: string, item_id: int, count: long`` with ids 1..num_items.

    Id 0 is left for padding. Ids follow descending interaction count, ties by
    ``raw_item`` ascending, so the same data always gets the same ids.
    """
    counts = (interactions.groupBy(F.col("item").alias("raw_item"))
              .agg(F.count(F.lit(1)).alias("count"))
              .withColumn("_prefix", F.substring("raw_item", 1, _VOCAB_PREFIX_CHARS)))
    # One row per bucket: at most distinct counts x distinct prefixes, a small
    # table, so an unpartitioned window over it is cheap.
    before = Window.orderBy(F.desc("count"), F.asc("_prefix")).rowsBetween(Window.unboundedPreceding, -1)
    offsets = (counts.groupBy("count", "_prefix").agg(F.count(F.lit(1)).alias("_n"))
               .withColumn("_offset", F.coalesce(F.sum("_n").over(before), F.lit(0)))
               .select("count", "_prefix", "_offset"))
    within = Window.partitionBy("count", "_prefix").orderBy("raw_item")
    return (counts.join(offsets, ["count", "_prefix"])
            .select("raw_item",
                    (F.col("_offset") + F.row_number().over(within)).cast("int").alias("item_id"),
                    "count"))


def apply_item_vocab(interactions: DataFrame, vocab: DataFrame) -> DataFrame:
    """Interactions with an ``item_id: int`` column appended.

    Inner join: interactions whose item is not in ``vocab`` are dropped, which
    only happens when the vocabulary was built from other data.
    """
    ids = vocab.select(F.col("raw_item").alias("item"), F.col("item_id").cast("int"))
    return interactions.join(ids, "item").select(*interactions.columns, "item_id")


def build_sequences(interactions: DataFrame, max_seq_len: int, repeated: Observation | None = None) -> DataFrame:
    """Per-user leave-one-out sequences (module docstring has the schema).

    With ``repeated``, the action that computes the sequences (their write) also fills
    ``repeated.get["repeated"]``: the rows whose (user_id, item_id, timestamp) an earlier
    row already has, over every user including the short ones dropped here, counted in
    the per-user aggregation that runs anyway (sorted events, so a repeat is equal to its
    predecessor on (timestamp, item_id)). It equals the rows
    ``freescale.prepare.ingest.drop_duplicate_interactions`` would drop, since item_id is one-to-one
    with the raw item.

    ``interactions`` is the canonical schema, with an ``item_id`` column from
    ``apply_item_vocab``; without one, a vocabulary is built here (callers
    that need to map ids back should build and keep it themselves).
    Order is by timestamp, then item_id, then rating, so ties are deterministic.
    """
    if max_seq_len < 1:
        raise InputError(f"max_seq_len must be >= 1, got {max_seq_len}")
    if "item_id" not in interactions.columns:
        interactions = apply_item_vocab(interactions, build_item_vocab(interactions))

    per_user = events_per_user(interactions, repeated)
    return _leave_one_out(per_user.where(F.col("_n") >= MIN_INTERACTIONS), max_seq_len)


def events_per_user(interactions: DataFrame, repeated: Observation | None = None) -> DataFrame:
    """``user_id, _events, _n``: each user's events, ``(timestamp, item_id, rating)`` structs in
    chronological order, and how many; ``interactions`` carries ``item_id``. With ``repeated``, the
    action that computes the rows fills ``repeated.get["repeated"]`` (see :func:`build_sequences`)."""
    # Sorting structs compares fields left to right: the chronological order
    # with the tie-breaks, done per user inside the aggregation.
    event = F.struct(
        F.col("timestamp").cast("long").alias("timestamp"),
        F.col("item_id").cast("int").alias("item_id"),
        F.col("rating").cast("float").alias("rating"),
    )
    per_user = (interactions.groupBy("user_id")
                .agg(F.sort_array(F.collect_list(event)).alias("_events"))
                .withColumn("_n", F.size("_events")))
    if repeated is not None:  # counted over every user, the short ones included
        per_user = per_user.observe(repeated, _repeated_total().alias("repeated"))
    return per_user


def user_states(per_user: DataFrame, max_seq_len: int) -> DataFrame:
    """The states (``STATE_COLUMNS``) of :func:`events_per_user` rows, every user's (short ones too)."""
    kept = F.least(F.col("_n"), F.lit(max_seq_len + MIN_INTERACTIONS - 1))
    return per_user.select("user_id", F.slice("_events", -kept, kept).alias("events"),
                           F.col("_n").cast("int").alias("num_interactions"))


def states_to_sequences(states: DataFrame, max_seq_len: int) -> DataFrame:
    """The sequences of the users of ``states`` with at least ``MIN_INTERACTIONS`` events, the same
    as :func:`build_sequences` of their whole logs; columns beyond ``STATE_COLUMNS`` (the user
    features) are carried after ``SEQUENCE_COLUMNS``."""
    extra = [c for c in states.columns if c not in STATE_COLUMNS]
    per_user = states.select("user_id", F.col("events").alias("_events"), F.col("num_interactions").alias("_n"),
                             *extra)
    return _leave_one_out(per_user.where(F.col("_n") >= MIN_INTERACTIONS), max_seq_len, extra)


def short_user_stats(states: DataFrame) -> dict[str, int]:
    """``users_dropped_short`` and ``interactions_dropped_short``: the users of ``states`` with too few
    events for a sequence, and their events (the counts :func:`sequence_stats` takes from the logs)."""
    row = (states.where(F.col("num_interactions") < MIN_INTERACTIONS)
           .agg(F.count(F.lit(1)).alias("users"), F.sum("num_interactions").alias("interactions")).first())
    return {"users_dropped_short": row["users"], "interactions_dropped_short": row["interactions"] or 0}


def _repeated_total() -> Column:
    """Over the rows of ``events_per_user``, the events equal to their predecessor on
    (timestamp, item_id): the repeated interactions (0 without rows)."""
    # Event i+2 (1-based) repeats its predecessor i+1: one linear scan of the sorted array
    # (array_distinct on the structs made this stage 3-10x slower at 200k users x 100 events).
    events = F.col("_events")
    later = F.slice(events, 2, F.col("_n") - 1)
    repeats = F.size(F.filter(later, lambda e, i: (e["timestamp"] == F.element_at(events, i + 1)["timestamp"])
                              & (e["item_id"] == F.element_at(events, i + 1)["item_id"])))
    return F.coalesce(F.sum(repeats), F.lit(0))


def _leave_one_out(per_user: DataFrame, max_seq_len: int, extra: list[str] = ()) -> DataFrame:
    """The sequences (``SEQUENCE_COLUMNS``, then ``extra``) of ``events_per_user`` rows with at least
    ``MIN_INTERACTIONS`` events (``_events`` may be only the last ones, ``_n`` counts them all): the
    last event is the test target, the one before the validation target, and the most recent
    ``max_seq_len`` of the rest the history."""
    size = F.size("_events")
    keep = F.least(size - 2, F.lit(max_seq_len))
    # Drop the two targets, then keep the most recent `keep` events.
    history = F.slice(F.slice("_events", 1, size - 2), -keep, keep).alias("_train")
    valid: Column = F.element_at("_events", -2)
    test: Column = F.element_at("_events", -1)
    return (per_user
            .select("user_id", history, valid.alias("_valid"), test.alias("_test"), "_n", *extra)
            .select(
                "user_id",
                F.col("_train.item_id").alias("items"),
                F.col("_train.timestamp").alias("timestamps"),
                F.col("_train.rating").alias("ratings"),
                F.size("_train").cast("int").alias("length"),
                F.col("_valid.item_id").alias("valid_item"),
                F.col("_valid.timestamp").alias("valid_timestamp"),
                # The test query's history ends with the validation item: scoring needs its rating too.
                F.col("_valid.rating").alias("valid_rating"),
                F.col("_test.item_id").alias("test_item"),
                F.col("_test.timestamp").alias("test_timestamp"),
                F.col("_n").cast("int").alias("num_interactions"),
                *extra,
            ))


def dropped_short_users(interactions: DataFrame) -> DataFrame:
    """``user_id, num_interactions`` of the users ``build_sequences`` drops."""
    return (interactions.groupBy("user_id")
            .agg(F.count(F.lit(1)).cast("int").alias("num_interactions"))
            .where(F.col("num_interactions") < MIN_INTERACTIONS))


def sequence_stats(sequences: DataFrame, interactions: DataFrame | None = None) -> dict:
    """Counts and length summary of ``build_sequences`` output (one tiny aggregate).

    ``users_truncated`` counts users whose history exceeded ``max_seq_len``.
    Dropped users are not in ``sequences``, so ``users_dropped_short`` and
    ``interactions_dropped_short`` are only present when ``interactions`` (the
    input to ``build_sequences``) is given; that costs one more aggregation.
    """
    row = sequences.agg(
        F.count(F.lit(1)).alias("users"),
        F.sum(F.when(F.col("num_interactions") - 2 > F.col("length"), 1).otherwise(0)).alias("users_truncated"),
        F.sum("num_interactions").alias("interactions"),
        F.sum("length").alias("train_interactions"),
        F.min("length").alias("length_min"),
        F.max("length").alias("length_max"),
        F.avg("length").alias("length_mean"),
        F.percentile_approx("length", 0.5).alias("length_p50"),
        F.percentile_approx("length", 0.99).alias("length_p99"),
    ).first().asDict()
    stats = {k: (0 if v is None and k in ("users_truncated", "interactions", "train_interactions") else v)
             for k, v in row.items()}
    if interactions is not None:
        short = dropped_short_users(interactions).agg(
            F.count(F.lit(1)).alias("users"), F.sum("num_interactions").alias("interactions")).first()
        stats["users_dropped_short"] = short["users"]
        stats["interactions_dropped_short"] = short["interactions"] or 0
    return stats
