"""`freescale prepare --previous PREPARED`: new logs on top of an earlier prepare output (daily
training), without starting over. freescale/jobs/prepare.py calls :func:`read_previous` before its
output exists and :func:`write_incremental` inside it.

The rules, each the plain prepare's own applied to the previous output plus the new logs:

- **Items** keep their ids (and their counts grow by the new logs'); items new to the catalog get
  ids after the previous largest, by their count in the new logs (descending), ties by raw item.
- **Users.** A user's state (``history/``: the last ``max_seq_len + 2`` events and the event count,
  freescale/prepare/sequences.py) is its previous state plus its new events, in time order; the
  split, the truncation and ``num_interactions`` then follow from it as in a plain prepare. Repeats
  of the same (user, item, timestamp) are dropped (unless --keep-duplicates) within the new logs
  and against the previous state, keeping the highest rating, and counted in ``duplicates_dropped``.
- **Late events**, new events older than the previous output's newest event, are merged in time
  order like any other and counted (``late_events``). One older than the user's kept window only
  adds to ``num_interactions``, as it would from scratch; a repeat of an event that left the window
  cannot be recognised and counts as a new event.
- **Ties.** A user's events of one timestamp are ordered by item id, as always; new items' ids
  differ from a from-scratch prepare's, so within such a tie the order may differ from one prepare
  of all the logs (the events, their timestamps and counts do not).
- **Output.** ``sequences/`` holds the users the new logs touch (returning and new); ``history/``
  holds every user (the untouched copied), so the next day's ``--previous`` reads this output.
- **User features** keep their values' ids, new values get ids after them; a user with a row in the
  new user table takes its features from it, any other keeps its previous ones.

A previous output without ``history/`` (written before it existed) is read from its sequences
(``items`` then the validation and test targets; the test rating is unknown): its users that were
too short for a sequence are not in it, so they start over as new users.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pyspark.sql import Column, DataFrame, Window
from pyspark.sql import functions as F

from freescale.prepare.prepared import HISTORY_DIR, METADATA_NAME, SEQUENCES_DIR, check_previous, parse_metadata
from freescale.prepare.sequences import MIN_INTERACTIONS, STATE_COLUMNS, build_item_vocab
from freescale.prepare.user_features import UNKNOWN_ID, USER_FEATURES_COLUMN, build_user_feature_vocab
from freescale.runtime.errors import InputError

if TYPE_CHECKING:
    from freescale.prepare.prepare_spec import PrepareSpec
    from freescale.prepare.spark_prepare import Inputs, Prepared

ITEM_VOCAB_DIR = "item_vocab"
FEATURE_VOCAB_DIR = "user_feature_vocab"


@dataclass
class Previous:
    """The previous output, as read."""

    uri: str
    metadata_text: str
    """Its prepare.json, as written (the run lists the previous output by its digest)."""
    meta: dict[str, Any]
    vocab: DataFrame
    states: DataFrame
    """Every user's state (``STATE_COLUMNS``, and ``user_features`` when it has features)."""
    state_source: str
    """Where the states came from: ``history`` or, for an output without it, ``sequences``."""
    feature_vocab: DataFrame | None
    feature_names: list[str]
    newest_timestamp: int | None


def read_previous(spark, fs, spec: PrepareSpec, inputs: Inputs) -> Previous:
    """The ``--previous`` output, checked: a prepare output with the same ``max_seq_len`` and, when
    the new logs come with a user table, the same user features."""
    uri = fs.qualify(spec.previous)
    meta_path = f"{uri}/{METADATA_NAME}"
    for required in (METADATA_NAME, SEQUENCES_DIR, ITEM_VOCAB_DIR):
        if not fs.exists(f"{uri}/{required}"):
            raise InputError(f"--previous {spec.previous} is not a `freescale prepare` output (no {required})")
    text = fs.read_text(meta_path)
    meta = parse_metadata(text, meta_path)
    check_previous(meta, spec.previous, spec.max_seq_len)
    names = [feature["name"] for feature in meta.get("user_features") or []]
    if inputs.users is not None and inputs.feature_names != names:
        raise InputError(f"--user-features {spec.user_features}: features {inputs.feature_names} differ from "
                         f"--previous {spec.previous}'s {names}; the model's inputs would change")
    if fs.exists(f"{uri}/{HISTORY_DIR}"):
        states, source = spark.read.parquet(f"{uri}/{HISTORY_DIR}"), "history"
    else:
        states, source = states_from_sequences(spark.read.parquet(f"{uri}/{SEQUENCES_DIR}")), "sequences"
    newest = states.agg(F.max(F.element_at("events", -1)["timestamp"])).first()[0]
    feature_vocab = spark.read.parquet(f"{uri}/{FEATURE_VOCAB_DIR}") if names else None
    return Previous(uri, text, meta, spark.read.parquet(f"{uri}/{ITEM_VOCAB_DIR}"), states, source, feature_vocab,
                    names, newest)


def states_from_sequences(sequences: DataFrame) -> DataFrame:
    """The states a prepare output's sequences imply: the training items, then the validation and
    the test target (whose rating the sequences do not keep: null); ``user_features`` carried."""
    timestamps, ratings = F.col("timestamps"), F.col("ratings")
    train = F.transform("items", lambda item, i: _event(timestamps[i], item, ratings[i]))
    valid = _event(F.col("valid_timestamp"), F.col("valid_item"), F.col("valid_rating"))
    test = _event(F.col("test_timestamp"), F.col("test_item"), F.lit(None))
    extra = [c for c in sequences.columns if c == USER_FEATURES_COLUMN]
    return sequences.select("user_id", F.concat(train, F.array(valid, test)).alias("events"),
                            F.col("num_interactions").cast("int").alias("num_interactions"), *extra)


def _event(timestamp: Column, item_id: Column, rating: Column) -> Column:
    """One event as ``freescale.prepare.sequences.events_per_user`` builds it."""
    return F.struct(timestamp.cast("long").alias("timestamp"), item_id.cast("int").alias("item_id"),
                    rating.cast("float").alias("rating"))


def extend_item_vocab(previous: DataFrame, interactions: DataFrame) -> DataFrame:
    """``previous`` (``raw_item, item_id, count``) with the counts of ``interactions`` added, and the
    items it lacks after it: ids from its largest + 1, by count descending, ties by raw item."""
    counts = interactions.groupBy(F.col("item").alias("raw_item")).agg(F.count(F.lit(1)).alias("_new"))
    kept = (previous.join(counts, "raw_item", "left")
            .select("raw_item", "item_id", (F.col("count") + F.coalesce(F.col("_new"), F.lit(0))).alias("count")))
    offset = previous.agg(F.max("item_id")).first()[0] or 0
    unseen = interactions.join(previous.select(F.col("raw_item").alias("item")), "item", "left_anti")
    added = build_item_vocab(unseen).select("raw_item", (F.col("item_id") + F.lit(offset)).cast("int").alias("item_id"),
                                            "count")
    return kept.unionByName(added)


def extend_feature_vocab(previous: DataFrame, users: DataFrame, names: list[str]) -> DataFrame:
    """``previous`` (``feature, value, id, count``) as it is, and the values of ``users`` it lacks
    after it: per feature, ids from its largest + 1 by user count descending, ties by value."""
    unseen = (build_user_feature_vocab(users, names).drop("id")
              .join(previous.select("feature", "value"), ["feature", "value"], "left_anti"))
    offsets = previous.groupBy("feature").agg(F.max("id").alias("_offset"))
    order = Window.partitionBy("feature").orderBy(F.desc("count"), F.asc("value"))
    added = (unseen.join(offsets, "feature", "left")
             .select("feature", "value",
                     (F.coalesce(F.col("_offset"), F.lit(0)) + F.row_number().over(order)).cast("int").alias("id"),
                     "count"))
    return previous.unionByName(added)


def merge_states(previous: DataFrame, per_user: DataFrame, max_seq_len: int, keep_duplicates: bool) -> DataFrame:
    """The states of the users of ``per_user`` (``events_per_user`` of the new logs): their previous
    events (none for a new user) and the new ones in time order, repeats dropped unless
    ``keep_duplicates``, the last ``max_seq_len + 2`` kept. Columns: ``STATE_COLUMNS``, the previous
    ``user_features`` when ``previous`` has them (null for a new user), ``returning`` (the user
    has a previous state) and ``duplicates`` (the events dropped as repeats)."""
    extra = [F.col(USER_FEATURES_COLUMN)] if USER_FEATURES_COLUMN in previous.columns else []
    old = previous.select("user_id", F.col("events").alias("_old"), F.col("num_interactions").alias("_old_n"), *extra)
    joined = per_user.join(old, "user_id", "left")
    merged = F.when(F.col("_old").isNull(), F.col("_events")).otherwise(F.sort_array(F.concat("_old", "_events")))
    with_merged = joined.withColumn("_merged", merged)
    kept = F.col("_merged") if keep_duplicates else without_repeats(F.col("_merged"))
    with_kept = with_merged.withColumn("_kept", kept)
    duplicates = (F.size("_merged") - F.size("_kept")).cast("int")
    window = F.least(F.size("_kept"), F.lit(max_seq_len + MIN_INTERACTIONS - 1))
    return with_kept.select(
        "user_id",
        F.slice("_kept", -window, window).alias("events"),
        (F.coalesce(F.col("_old_n"), F.lit(0)) + F.col("_n") - duplicates).cast("int").alias("num_interactions"),
        *extra,
        F.col("_old_n").isNotNull().alias("returning"),
        duplicates.alias("duplicates"))


def without_repeats(events: Column) -> Column:
    """Sorted ``events`` without the repeats of one (timestamp, item_id): a run of them keeps its last,
    the highest rating, as ``freescale.prepare.ingest.drop_duplicate_interactions`` keeps."""
    def repeated_by_next(event: Column, i: Column) -> Column:
        after = F.get(events, i + 1)  # null past the end
        return F.coalesce((event["timestamp"] == after["timestamp"]) & (event["item_id"] == after["item_id"]),
                          F.lit(False))

    return F.filter(events, lambda event, i: ~repeated_by_next(event, i))


def with_features(states: DataFrame, users: DataFrame | None, vocab: DataFrame, names: list[str]) -> DataFrame:
    """``states`` whose ``user_features`` (previous ones, or null) the user table's row replaces
    where it has one; null (a new user without a row) becomes unknown ids."""
    from freescale.prepare.user_features import encoded_users

    unknown = F.array_repeat(F.lit(UNKNOWN_ID), len(names))
    current = F.col(USER_FEATURES_COLUMN) if USER_FEATURES_COLUMN in states.columns else F.lit(None)
    if users is None:
        return states.withColumn(USER_FEATURES_COLUMN, F.coalesce(current, unknown))
    encoded = encoded_users(users, vocab, names).withColumnRenamed(USER_FEATURES_COLUMN, "_new_features")
    return (states.join(encoded, "user_id", "left")
            .withColumn(USER_FEATURES_COLUMN, F.coalesce(F.col("_new_features"), current, unknown))
            .drop("_new_features"))


def write_incremental(spark, fs, staging: str, spec: PrepareSpec, inputs: Inputs, previous: Previous) -> Prepared:
    """The previous output extended with ``inputs`` (the module docstring has the rules) under
    ``staging``: the vocabularies, every user's state, the touched users' sequences and prepare.json."""
    from freescale.prepare.ingest import drop_duplicate_interactions
    from freescale.prepare.spark_prepare import Prepared, finish_metadata, output_stats, write_sequences
    from freescale.runtime.session import checkpoint

    interactions = inputs.interactions
    if not spec.keep_duplicates:
        interactions = checkpoint(drop_duplicate_interactions(interactions))
    newest = previous.newest_timestamp
    counted = interactions.agg(F.count(F.lit(1)).alias("rows"), F.coalesce(F.sum(
        (F.col("timestamp") < F.lit(newest)).cast("long")), F.lit(0)).alias("late")).first()
    vocab, feature_vocab = _write_vocabularies(spark, staging, inputs, previous, interactions)
    touched, history = _write_states(spark, staging, spec, inputs, previous, vocab, interactions, feature_vocab)
    sequences = write_sequences(spark, staging, touched.select(*history.columns), spec.max_seq_len)
    users = touched.agg(F.count(F.lit(1)).alias("touched"), F.sum(F.col("returning").cast("long")).alias("returning"),
                        F.coalesce(F.sum("duplicates"), F.lit(0)).alias("duplicates")).first()
    duplicates = inputs.counts["interactions"] - counted["rows"] + users["duplicates"]
    stats = {"input_interactions": inputs.counts["interactions"], "input_users": inputs.counts["users"],
             "duplicates_dropped": duplicates, **output_stats(vocab, touched, sequences, inputs.users),
             "returning_users": users["returning"] or 0, "new_users": users["touched"] - (users["returning"] or 0),
             "unchanged_users": history.count() - users["touched"],
             "new_items": vocab.count() - previous.vocab.count(), "late_events": counted["late"]}
    extra = {"previous": {"uri": previous.uri, "state": previous.state_source, "newest_timestamp": newest}}
    meta = finish_metadata(fs, staging, spec, inputs.source, stats, feature_vocab, previous.feature_names, extra)
    return Prepared(meta, stats, duplicates, 0 if spec.keep_duplicates else duplicates)


def _write_vocabularies(spark, staging: str, inputs: Inputs, previous: Previous,
                        interactions: DataFrame) -> tuple[DataFrame, DataFrame | None]:
    """The extended item vocabulary and, with user features, the feature vocabulary (extended by the
    new user table, or the previous one as it was), written and read back."""
    extend_item_vocab(previous.vocab, interactions).write.parquet(f"{staging}/{ITEM_VOCAB_DIR}")
    vocab = spark.read.parquet(f"{staging}/{ITEM_VOCAB_DIR}")
    if not previous.feature_names:
        return vocab, None
    feature_vocab = previous.feature_vocab
    if inputs.users is not None:
        feature_vocab = extend_feature_vocab(feature_vocab, inputs.users, previous.feature_names)
    feature_vocab.write.parquet(f"{staging}/{FEATURE_VOCAB_DIR}")
    return vocab, spark.read.parquet(f"{staging}/{FEATURE_VOCAB_DIR}")


def _write_states(spark, staging: str, spec: PrepareSpec, inputs: Inputs, previous: Previous, vocab: DataFrame,
                  interactions: DataFrame, feature_vocab: DataFrame | None) -> tuple[DataFrame, DataFrame]:
    """The touched users' states (checkpointed, with ``returning`` and ``duplicates``) and every
    user's, written as ``history/`` and read back."""
    from freescale.prepare.sequences import apply_item_vocab, events_per_user
    from freescale.runtime.session import checkpoint

    per_user = events_per_user(apply_item_vocab(interactions, vocab))
    touched = merge_states(previous.states, per_user, spec.max_seq_len, spec.keep_duplicates)
    untouched = previous.states.join(per_user.select("user_id"), "user_id", "left_anti")
    if previous.feature_names:
        touched = with_features(touched, inputs.users, feature_vocab, previous.feature_names)
        untouched = with_features(untouched, inputs.users, feature_vocab, previous.feature_names)
    touched = checkpoint(touched)
    columns = [*STATE_COLUMNS, *([USER_FEATURES_COLUMN] if previous.feature_names else [])]
    touched.select(*columns).unionByName(untouched.select(*columns)).write.parquet(f"{staging}/{HISTORY_DIR}")
    return touched, spark.read.parquet(f"{staging}/{HISTORY_DIR}")
