"""Synthetic interactions with realistic skew, generated inside Spark at any scale.

Balancing only matters when history lengths and item popularity are skewed, so
the generator reproduces both, with MovieLens-like defaults:

* History length per user: log-normal, ``L = round(exp(mu + sigma * z))`` with
  ``z ~ N(0, 1)``, clipped to ``[min_len, max_len]``. Defaults mu=4.2,
  sigma=0.9 give a median of ~67 (MovieLens-100K: 65) and p99/p50 ~ 8.
* Item per event: continuous Zipf (density ~ x^-alpha on [1, num_items+1))
  sampled by inverse CDF and floored, so item "1" is the most popular and the
  share of item rank r falls like r^-alpha. Default alpha=1.1.
* Taste groups (opt-in, ``taste_groups=G`` > 0; off by default, when every
  item comes from the one global law above and most-popular is the best
  possible ranking): each user belongs to one of G groups (a uniform per
  user), and each event's item is, with probability ``taste_share`` (default
  0.8), its Zipf rank counted in the user's group's own slice of the catalog
  (rank r of group g is item ``(r - 1 + offset_g) mod num_items + 1``, with
  ``offset_g = (g + 1) * num_items // (G + 1)``), else the global item of that
  rank. Each group has its own favourites, mid-catalog globally, so a user's
  history predicts its next items far better than global popularity does.
  Item labels are then no longer exact popularity ranks.
* Timestamps: each user starts at ``start_ts`` plus up to ``START_SPREAD_S``
  and has its own mean gap between events (log-uniform in
  ``[MIN_GAP_S, MAX_GAP_S]``); event k is at ``start + k*gap + jitter`` with
  ``0 <= jitter < gap``, strictly increasing without a window over the user.
* Ratings 1..5 with MovieLens-100K's marginal frequencies (``RATING_CDF``).

Every random number is a hash of (seed, user, position, salt) via ``xxhash64``,
never ``rand()``: a value does not depend on which partition computes it, so
the same seed gives the same rows for any ``partitions``.

Pipeline: ``spark.range(num_users)`` -> per-user length -> ``explode(sequence)``
-> per-event item, timestamp, rating. No shuffle, no driver data.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from pyspark.sql import Column, DataFrame, SparkSession
from pyspark.sql import functions as F

from freescale.runtime.errors import InputError


@dataclass(frozen=True)
class SyntheticDefaults:
    """Defaults of ``synthetic_interactions``; see the module docstring."""

    seed: int = 0
    mu: float = 4.2
    sigma: float = 0.9
    min_len: int = 20
    max_len: int = 1024
    zipf_alpha: float = 1.1
    start_ts: int = 1_600_000_000  # 2020-09-13 UTC
    taste_groups: int = 0  # 0: no groups, every item from the global law
    taste_share: float = 0.8


DEFAULTS = SyntheticDefaults()

START_SPREAD_S = 365 * 86_400  # user start times spread over a year
MIN_GAP_S, MAX_GAP_S = 60, 86_400  # per-user mean gap between events
# Cumulative P(rating <= r) for r = 1..4 in MovieLens-100K (6%, 11%, 27%, 34%, 21%).
RATING_CDF = (0.061, 0.175, 0.447, 0.788)

# Salts keep the uniforms drawn for different purposes independent.
_SALT_LEN_1, _SALT_LEN_2, _SALT_START, _SALT_GAP, _SALT_GROUP = 1, 2, 3, 4, 5
_SALT_ITEM, _SALT_JITTER, _SALT_RATING, _SALT_TASTE = 11, 12, 13, 14
_MANTISSA = 1 << 53


def _uniform(seed: int, user: Column, pos: Column, salt: int) -> Column:
    """Uniform in (0, 1) from a hash: 53 bits, offset by half a step so log() is finite."""
    h = F.xxhash64(F.lit(seed).cast("long"), user.cast("long"), pos.cast("long"), F.lit(salt).cast("long"))
    return (h.bitwiseAND(F.lit(_MANTISSA - 1)).cast("double") + F.lit(0.5)) / F.lit(float(_MANTISSA))


def _zipf_rank(u: Column, num_items: int, alpha: float) -> Column:
    """Inverse CDF of a continuous Zipf on [1, num_items+1), floored to 1..num_items."""
    top = float(num_items + 1)
    if abs(alpha - 1.0) < 1e-9:
        x = F.pow(F.lit(top), u)
    else:
        e = 1.0 - alpha
        x = F.pow(F.lit(1.0) + u * F.lit(top ** e - 1.0), F.lit(1.0 / e))
    # Rounding at the top edge can reach num_items+1; clamp into range.
    return F.least(F.greatest(F.floor(x), F.lit(1)), F.lit(num_items)).cast("long")


def synthetic_interactions(
    spark: SparkSession,
    num_users: int,
    num_items: int,
    *,
    seed: int = DEFAULTS.seed,
    mu: float = DEFAULTS.mu,
    sigma: float = DEFAULTS.sigma,
    min_len: int = DEFAULTS.min_len,
    max_len: int = DEFAULTS.max_len,
    zipf_alpha: float = DEFAULTS.zipf_alpha,
    start_ts: int = DEFAULTS.start_ts,
    taste_groups: int = DEFAULTS.taste_groups,
    taste_share: float = DEFAULTS.taste_share,
    partitions: int | None = None,
) -> DataFrame:
    """Interactions in the canonical schema (``user_id, item, timestamp, rating``).

    ``user_id`` is "0".."num_users-1" and ``item`` "1".."num_items" (popularity
    rank; with ``taste_groups``, a rank in the user's group's slice or the global
    one). ``partitions`` sets the width of ``spark.range`` (default: Spark's
    default parallelism); it changes the layout, never the rows.
    """
    _check_arguments(num_users, num_items, mu, sigma, min_len, max_len, zipf_alpha)
    _check_groups(taste_groups, taste_share)
    users = spark.range(0, num_users, numPartitions=partitions).withColumnRenamed("id", "_u")
    u = F.col("_u")
    length = _history_length(seed, u, mu, sigma, min_len, max_len)
    start, gap = _user_clock(seed, u, start_ts)
    events = (users
              .select(u, length.alias("_len"), start.alias("_start"), gap.alias("_gap"))
              .select(u, "_start", "_gap", F.explode(F.sequence(F.lit(0), F.col("_len") - 1)).alias("_pos")))

    pos = F.col("_pos")
    item = _zipf_rank(_uniform(seed, u, pos, _SALT_ITEM), num_items, zipf_alpha)
    if taste_groups:
        item = _group_item(seed, u, pos, item, num_items, taste_groups, taste_share)
    jitter = F.floor(_uniform(seed, u, pos, _SALT_JITTER) * F.col("_gap")).cast("long")
    timestamp = F.col("_start") + pos.cast("long") * F.col("_gap") + jitter
    # Named once so the rating `when` chain tests one value, not four hashes.
    events = events.withColumn("_r", _uniform(seed, u, pos, _SALT_RATING))
    return events.select(
        u.cast("string").alias("user_id"),
        item.cast("string").alias("item"),
        timestamp.alias("timestamp"),
        _rating(F.col("_r")).cast("float").alias("rating"),
    )


def _check_arguments(num_users: int, num_items: int, mu: float, sigma: float, min_len: int, max_len: int,
                     zipf_alpha: float) -> None:
    """InputError on a size, length range or distribution parameter ``synthetic_interactions`` cannot use."""
    if num_users < 1 or num_items < 1:
        raise InputError(f"num_users and num_items must be >= 1, got {num_users} and {num_items}")
    if not 1 <= min_len <= max_len:
        raise InputError(f"need 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
    if not (sigma >= 0 and math.isfinite(mu) and math.isfinite(sigma)):
        raise InputError(f"need finite mu and sigma >= 0, got mu={mu}, sigma={sigma}")
    if not zipf_alpha > 0:
        raise InputError(f"zipf_alpha must be > 0, got {zipf_alpha}")


def _check_groups(taste_groups: int, taste_share: float) -> None:
    """InputError on a taste group setting ``synthetic_interactions`` cannot use."""
    if taste_groups < 0:
        raise InputError(f"taste_groups must be >= 0 (0: none), got {taste_groups}")
    if not 0.0 <= taste_share <= 1.0:
        raise InputError(f"taste_share must be in [0, 1], got {taste_share}")


def _group_item(seed: int, user: Column, pos: Column, rank: Column, num_items: int, groups: int,
                share: float) -> Column:
    """The event's item under taste groups: with probability ``share`` the Zipf ``rank`` counted from
    the user's group's offset (wrapping around the catalog), else the global item of that rank."""
    # The uniform can round to 1.0 at the top: clamp the group into 0..groups-1.
    group = F.least(F.floor(_uniform(seed, user, F.lit(0), _SALT_GROUP) * F.lit(groups)), F.lit(groups - 1))
    # Exact in doubles: (group + 1) * num_items stays far below 2**52.
    offset = F.floor((group + F.lit(1)) * F.lit(num_items) / F.lit(groups + 1)).cast("long")
    in_group = _uniform(seed, user, pos, _SALT_TASTE) < F.lit(share)
    shifted = F.pmod(rank - F.lit(1) + offset, F.lit(num_items)) + F.lit(1)
    return F.when(in_group, shifted).otherwise(rank).cast("long")


def _history_length(seed: int, user: Column, mu: float, sigma: float, min_len: int, max_len: int) -> Column:
    """Each user's history length: log-normal ``round(exp(mu + sigma * z))``, clipped to
    ``[min_len, max_len]`` (int)."""
    zero = F.lit(0)
    # Box-Muller: two uniforms -> one standard normal.
    u1, u2 = _uniform(seed, user, zero, _SALT_LEN_1), _uniform(seed, user, zero, _SALT_LEN_2)
    z = F.sqrt(F.lit(-2.0) * F.log(u1)) * F.cos(F.lit(2 * math.pi) * u2)
    raw_len = F.round(F.exp(F.lit(mu) + F.lit(sigma) * z))
    return F.least(F.greatest(raw_len, F.lit(min_len)), F.lit(max_len)).cast("int")


def _user_clock(seed: int, user: Column, start_ts: int) -> tuple[Column, Column]:
    """(start, mean gap) of each user's events, in seconds (longs): the start up to
    ``START_SPREAD_S`` after ``start_ts``, the gap log-uniform in ``[MIN_GAP_S, MAX_GAP_S]``."""
    zero = F.lit(0)
    start = F.lit(start_ts) + F.floor(_uniform(seed, user, zero, _SALT_START) * START_SPREAD_S).cast("long")
    log_gap = math.log(MIN_GAP_S) + _uniform(seed, user, zero, _SALT_GAP) * (math.log(MAX_GAP_S) - math.log(MIN_GAP_S))
    return start, F.floor(F.exp(log_gap)).cast("long")


def _rating(r: Column) -> Column:
    """The rating (1.0..5.0) whose cumulative frequency (``RATING_CDF``) bracket holds the uniform ``r``."""
    rating = F.when(r < RATING_CDF[0], 1.0)
    for k, edge in enumerate(RATING_CDF[1:], start=2):
        rating = rating.when(r < edge, float(k))
    return rating.otherwise(5.0)
