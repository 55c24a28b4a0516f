"""The prepare job's options, declared once: `freescale prepare`'s command line and the pipeline's
``[prepare]`` section are derived from ``PrepareSpec`` (freescale/runtime/options.py), and the spec is what
freescale/prepare/spark_prepare.py takes. Standard library only.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from freescale.runtime.errors import InputError
from freescale.prepare.layouts import FORMATS  # plain data
from freescale.runtime.options import option

FormatName = Literal[FORMATS]  # type: ignore[valid-type]
CLI = ("cli",)
SYNTHETIC = "synthetic data (when --input is omitted)"


@dataclass(frozen=True, kw_only=True)
class PrepareSpec:
    """Raw logs (or the synthetic generator) in, prepared sequences out."""

    SURFACES = ("cli", "pipeline")
    """`freescale prepare`'s options, the pipeline's [prepare] keys."""

    input: str | None = option(None, "interaction log: Parquet, CSV or a MovieLens file/directory "
                                     "(omit for the synthetic generator)")
    output: str = option(help="directory to create", surfaces=CLI)
    format: FormatName | None = option(
        None, "input format (default: from the file name); user-item-lines: one `user item` pair per line, a "
              "user's lines in time order, the line number as timestamp (SASRec's ml-1m.txt, Beauty.txt)")
    previous: str | None = option(
        None, "an earlier prepare output to extend with --input's new logs (daily training): its items and "
              "feature values keep their ids, new ones get ids after them, a returning user's sequence goes on "
              "from its history; sequences/ then holds only the users the new logs touch", surfaces=CLI,
        metavar="PREPARED")
    user_col: str | None = option(None, "user column (default: user_id/userId/user/uid)", surfaces=CLI)
    item_col: str | None = option(None, "item column (default: item_id/movie_id/movieId/item/iid)", surfaces=CLI)
    time_col: str | None = option(None, "timestamp column (default: timestamp/ts/time/event_time)", surfaces=CLI)
    rating_col: str | None = option(None, "optional rating/action column (default: rating/action/score)",
                                    surfaces=CLI)
    user_features: str | None = option(None, "user table (Parquet or CSV): a user column plus categorical "
                                             "feature columns, e.g. MovieLens users.parquet")
    user_feature_cols: str | None = option(None, "comma-separated feature columns of --user-features "
                                                 "(default: every column but the user column)")
    max_seq_len: int = option(1024, "keep the most recent N training items per user", positive=True)
    keep_duplicates: bool = option(False, "keep repeated (user, item, timestamp) rows; by default they are dropped "
                                          "and counted (a duplicated last event would make the test target equal "
                                          "the validation target)")
    synthetic_users: int = option(20_000, "users", group=SYNTHETIC)
    synthetic_items: int = option(10_000, "catalog size", group=SYNTHETIC)
    seed: int = option(0, "generator seed", group=SYNTHETIC)
    synthetic_groups: int = option(
        0, "taste groups: each user belongs to one of this many groups and draws its items, with probability "
           "--synthetic-group-share, from its group's own Zipf law over a slice of the catalog, so its history "
           "predicts its next items beyond popularity (default 0: none, every item from one global Zipf law, "
           "where most-popular is the best possible ranking)", group=SYNTHETIC)
    synthetic_group_share: float = option(0.8, "with --synthetic-groups: the share of events drawn from the "
                                               "user's group, in [0, 1]", group=SYNTHETIC)
    overwrite: bool = option(False, "replace an existing output", surfaces=CLI)
    master: str | None = option(None, "Spark master (default: spark-submit's, else local[*])", surfaces=CLI)

    @property
    def feature_columns(self) -> list[str] | None:
        """``--user-feature-cols`` as a list; None: every column of the user table but the user column."""
        if not self.user_feature_cols:
            return None
        return [c.strip() for c in self.user_feature_cols.split(",") if c.strip()]

    def check(self) -> None:
        """The generator's sizes count only when it runs; its group settings are checked always."""
        if self.input is None:
            for name in ("synthetic_users", "synthetic_items"):
                if getattr(self, name) <= 0:
                    raise InputError(f"--{name.replace('_', '-')} must be a positive integer, got {getattr(self, name)}")
        if self.previous is not None and self.input is None:
            raise InputError("--previous extends an earlier output with new logs: pass them as --input")
        if self.synthetic_groups < 0:
            raise InputError(f"--synthetic-groups must be >= 0 (0: none), got {self.synthetic_groups}")
        if not 0.0 <= self.synthetic_group_share <= 1.0:
            raise InputError(f"--synthetic-group-share must be in [0, 1], got {self.synthetic_group_share}")

    @property
    def synthetic_source(self) -> dict[str, Any]:
        """What prepare.json records of the generator: its sizes and seed, and its groups when on."""
        source: dict[str, Any] = {"kind": "synthetic", "users": self.synthetic_users, "items": self.synthetic_items,
                                  "seed": self.seed}
        if self.synthetic_groups:
            source.update(groups=self.synthetic_groups, group_share=self.synthetic_group_share)
        return source


def synthetic_text(settings: Any) -> str:
    """The generator's settings (a PrepareSpec or the pipeline's [prepare] section) for a summary line:
    "U users, I items, seed S" and ", G taste groups (share P)" when they are on."""
    groups = (f", {settings.synthetic_groups} taste groups (share {settings.synthetic_group_share})"
              if settings.synthetic_groups else "")
    return f"{settings.synthetic_users} users, {settings.synthetic_items} items, seed {settings.seed}{groups}"
