"""Input checks that need no Spark: run before the session starts, so bad input fails in
a second instead of after Spark's ~10-30 s start.

Local paths only (plain or ``file:``); a remote path is left to the Spark-side checks,
which stay in place for every path. What is checked: the path exists, the input
format can be told, for Parquet every data file has a readable footer (pyarrow),
for CSV every data file's header (and a gzip file to its end when it is small), and
in both the columns the job needs, spelt alike in every file, and at least one row; for
a line-order file (``user item`` per line) its first lines. Errors are one-line
:class:`InputError` naming the file and the column.

A standalone Spark master is checked before the session too (freescale.runtime.spark_master): one that takes no connection
fails in seconds instead of after Spark's minute of registration tries.

No pyspark here; pyarrow is imported when a Parquet file is actually checked.
"""
from __future__ import annotations

import csv
import gzip
import itertools
import os
import re
import zlib
from pathlib import Path

from freescale.runtime.errors import InputError, one_line
from freescale.prepare.layouts import (
    COMPRESSION_SUFFIXES,
    FORMATS,
    ITEM_COLUMNS,
    LAYOUT_BY_FORMAT,
    LINE_ORDER_FORMATS,
    MOVIELENS_LAYOUTS,
    RATING_COLUMNS,
    TIME_COLUMNS,
    USER_COLUMNS,
    uncompressed_name,
)
from freescale.runtime.paths import local_path



def format_from_name(path: str) -> str:
    name = path.rstrip("/").rsplit("/", 1)[-1]
    if name in MOVIELENS_LAYOUTS:
        return MOVIELENS_LAYOUTS[name][0]
    if name.endswith(".parquet"):
        return "parquet"
    plain = uncompressed_name(name)  # Spark reads ratings.csv.gz as CSV
    if plain.endswith(".csv"):
        return "csv"
    if plain.endswith(".txt"):  # told, not guessed: a .txt can be anything
        raise InputError(f"{path}: unknown format (a plain `user item` per-line file needs "
                         f"--format {next(iter(LINE_ORDER_FORMATS))})")
    raise InputError(f"{path}: unknown format (expected .parquet, .csv (or compressed: .csv.gz, ...), u.data, "
                     "ratings.dat or ratings.csv; pass --format)")


def resolve_input(path: str, fmt: str | None) -> tuple[str, str]:
    """``(format, concrete path to read)`` of an interaction log, detecting the format when not given.

    A directory holding a MovieLens file (or ``ratings.parquet``) resolves to that file.
    """
    if fmt is not None and fmt not in FORMATS:
        raise InputError(f"{path}: unknown format {fmt!r} (expected one of {', '.join(FORMATS)})")
    local = local_path(path)
    if local is None:
        # Remote filesystems cannot be listed cheaply here; trust the caller or the suffix.
        return fmt or format_from_name(path), path
    p = Path(local)
    if not p.exists():
        raise InputError(f"{path}: path does not exist")
    if fmt in LINE_ORDER_FORMATS and not p.is_file():
        raise InputError(f"{path}: --format {fmt} reads one file, not a folder (the line order is the time order)")
    if p.is_file():
        return fmt or format_from_name(path), path
    # Directory: a MovieLens layout inside it, else a Parquet/CSV dataset directory.
    if fmt in LAYOUT_BY_FORMAT:
        name = LAYOUT_BY_FORMAT[fmt][0]
        return fmt, str(p / name) if (p / name).is_file() else path
    if fmt is None:
        for name, layout in MOVIELENS_LAYOUTS.items():
            if (p / name).is_file():
                return layout[0], str(p / name)
    if fmt in (None, "parquet") and (p / "ratings.parquet").exists():
        return "parquet", str(p / "ratings.parquet")
    if fmt is not None:
        return fmt, path
    names = [q.name for q in p.iterdir() if not q.name.startswith((".", "_"))]
    if any(n.endswith(".parquet") for n in names):
        return "parquet", path
    if any(uncompressed_name(n).endswith(".csv") for n in names):
        return "csv", path
    raise InputError(f"{path}: unknown format (no u.data, ratings.dat, ratings.csv, *.parquet or *.csv inside; "
                     "pass --format)")


def pick_column(columns: list[str], source: str, role: str, explicit: str | None,
                candidates: tuple[str, ...], *, required: bool) -> str | None:
    """Actual column name for ``role``: the explicit one, else the first recognised name
    (case-insensitive)."""
    by_lower = {c.lower(): c for c in columns}
    if explicit is not None:
        if explicit in columns:
            return explicit
        if explicit.lower() in by_lower:
            return by_lower[explicit.lower()]
        raise InputError(f"{source}: {role} column {explicit!r} not found; available columns: {', '.join(columns)}")
    for name in candidates:
        if name.lower() in by_lower:
            return by_lower[name.lower()]
    if not required:
        return None
    flag = "--time-col" if role == "timestamp" else f"--{role}-col"
    raise InputError(
        f"{source}: missing {role} column (looked for {', '.join(candidates)}; use {flag}); "
        f"available columns: {', '.join(columns)}"
    )


def _data_files(root: Path) -> list[tuple[Path, list[str]]]:
    """Spark's view of a Parquet dataset directory: every file not starting with ``.`` or ``_``,
    with the partition columns of the ``key=value`` folders above it."""
    found = []
    for folder, dirs, files in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "_")))
        rel = Path(folder).relative_to(root).parts
        keys = [part.split("=", 1)[0] for part in rel if "=" in part]
        found.extend((Path(folder) / f, keys) for f in sorted(files) if not f.startswith((".", "_")))
    return found


def parquet_footers(path: str, what: str = "", hint: str = "") -> tuple[list[tuple[str, list[str]]], int] | None:
    """Per data file ``(file, columns)`` and the total row count, read from the footers of a
    local Parquet file or dataset directory; None for a remote path.

    Raises InputError naming the file whose footer is unreadable, or the directory when it
    holds no data file. ``what`` prefixes the messages (e.g. ``"input "``), ``hint`` ends them.
    """
    import pyarrow.parquet as pq

    local = local_path(path)
    if local is None:
        return None
    hint = f"; {hint}" if hint else ""
    root = Path(local)
    if not root.exists():
        raise InputError(f"{what}{path} does not exist")
    files = [(root, [])] if root.is_file() else _data_files(root)
    if not files:
        raise InputError(f"{what}{path}: no Parquet data files inside{hint}")
    footers, rows = [], 0
    for file, partition_keys in files:
        try:
            meta = pq.read_metadata(file)
        except Exception as exc:  # noqa: BLE001 - pyarrow raises ArrowInvalid, OSError, ...
            raise InputError(f"{what}{file} is not readable Parquet: {one_line(exc)}{hint}") from None
        footers.append((str(file), [*meta.schema.to_arrow_schema().names, *partition_keys]))
        rows += meta.num_rows
    return footers, rows


# Lines of a line-order file that preflight reads: enough to catch a wrong file or layout in
# well under a second; Spark checks every line.
PREFLIGHT_LINES = 1000
# Compressions Hadoop reads but preflight does not open (gzip it does).
_UNOPENED_SUFFIXES = tuple(s for s in COMPRESSION_SUFFIXES if s != ".gz")
# A gzip file up to this size is read to its end before Spark starts (about a second), so a
# truncated one fails at once; a larger one is left to Spark's read, which names it too.
GZIP_CHECK_BYTES = 64 << 20


def _csv_head(file: Path, sep: str, header: bool, names: tuple[str, ...] | None) -> tuple[list[str] | None, bool]:
    """A CSV data file's columns (its header's, or the layout's ``names`` when headerless; None for
    a file with no line) and whether it holds a data line, as Spark's reader sees them (blank lines
    skipped)."""
    opener = gzip.open if file.name.endswith(".gz") else open
    try:
        # utf-8-sig: a byte-order mark is not part of the first column's name.
        with opener(file, "rt", encoding="utf-8-sig", errors="replace") as text:
            lines = (line for line in itertools.islice(text, PREFLIGHT_LINES) if line.strip())
            first = next(lines, None)
            if not header:
                columns, rows = list(names or ()), first is not None
            elif first is None:
                columns, rows = None, False
            else:
                columns, rows = next(csv.reader([first.rstrip("\r\n")], delimiter=sep)), next(lines, None) is not None
            if opener is gzip.open and file.stat().st_size <= GZIP_CHECK_BYTES:
                while text.buffer.read(1 << 20):
                    pass
    except (OSError, EOFError, zlib.error) as exc:  # unreadable, not gzip after all, or cut short
        raise InputError(f"{file}: cannot read: {one_line(exc)}") from None
    return columns, rows


def csv_files(path: str, fmt: str) -> list[tuple[str, list[str] | None, bool | None]] | None:
    """Per data file of a local CSV file or folder, as Spark's reader lists them: ``(file, columns,
    has_rows)`` (see ``_csv_head``; both None for a compression preflight does not open); None for a
    remote path. ``fmt`` is ``csv`` or a MovieLens text layout."""
    local = local_path(path)
    if local is None:
        return None
    sep, header, names = (",", True, None) if fmt == "csv" else LAYOUT_BY_FORMAT[fmt][1:]
    root = Path(local)
    found: list[tuple[str, list[str] | None, bool | None]] = []
    for file, partition_keys in [(root, [])] if root.is_file() else _data_files(root):
        if file.name.endswith(_UNOPENED_SUFFIXES):
            found.append((str(file), None, None))
            continue
        columns, rows = _csv_head(file, sep, header, names)
        found.append((str(file), None if columns is None else [*columns, *partition_keys], rows))
    return found


def bad_line_message(source: str, fmt: str, line: int, text: str, bad: int | None = None,
                     total: int | None = None) -> str:
    """The one-line error for a malformed line of a ``LINE_ORDER_FORMATS`` file (1-based ``line``)."""
    shape = LINE_ORDER_FORMATS[fmt][0]
    shown = repr(text) if len(text) <= 60 else repr(text[:60]) + "..."
    if bad is None:
        return f"{source}: line {line}: expected {shape}, got {shown}"
    return f"{source}: {bad} of {total} lines are not {shape}; the first, line {line}, is {shown}"


def check_line_layout_columns(fmt: str, **columns: str | None) -> None:
    """A line-order layout has positional fields: a ``*_col`` option names nothing in it."""
    given = [name for name, value in columns.items() if value is not None]
    if fmt in LINE_ORDER_FORMATS and given:
        flag = "--" + given[0].replace("_", "-")
        raise InputError(f"{flag} does not apply to --format {fmt} (its fields are positional: user, item; "
                         "the line number is the timestamp)")


def check_lines(source: str, fmt: str) -> None:
    """The first ``PREFLIGHT_LINES`` lines of a local line-order file match its layout, and it
    has a line at all."""
    local = local_path(source)
    if local is None or source.endswith(_UNOPENED_SUFFIXES):
        return
    pattern = re.compile(LINE_ORDER_FORMATS[fmt][1])
    opener = gzip.open if source.endswith(".gz") else open
    seen = 0
    try:
        # Universal newlines split on \n, \r\n and \r, as Hadoop's line reader does.
        with opener(local, "rt", encoding="utf-8", errors="replace") as lines:
            for seen, text in enumerate(itertools.islice(lines, PREFLIGHT_LINES), 1):
                text = text.rstrip("\n")
                if not pattern.fullmatch(text):
                    raise InputError(bad_line_message(source, fmt, seen, text))
    except OSError as exc:  # unreadable, or not gzip after all
        raise InputError(f"{source}: cannot read: {' '.join(str(exc).split())}") from None
    if seen == 0:
        raise InputError(f"{source}: empty input (zero lines)")


def check_interactions(path: str, fmt: str | None, *, user_col: str | None = None, item_col: str | None = None,
                       time_col: str | None = None, rating_col: str | None = None) -> None:
    """What ``freescale.prepare.ingest.read_interactions`` would reject first, found without Spark:
    a missing path, an unknown format, for Parquet an unreadable footer, a missing
    user/item/timestamp column (or a named ``*_col`` absent) or zero rows, and for a
    line-order file a column option, a folder, or a malformed line among the first."""
    fmt, source = resolve_input(path, fmt)
    if fmt in LINE_ORDER_FORMATS:
        check_line_layout_columns(fmt, user_col=user_col, item_col=item_col, time_col=time_col,
                                  rating_col=rating_col)
        check_lines(source, fmt)
        return
    if fmt == "parquet":
        scanned = parquet_footers(source)
        if scanned is None:
            return
        files, empty = [(file, columns) for file, columns in scanned[0]], scanned[1] == 0
    else:
        found = csv_files(source, fmt)
        if found is None:
            return
        files = [(file, columns) for file, columns, _ in found if columns is not None]
        empty = all(rows is False for _, _, rows in found)
        if empty and not files:  # what Spark's CSV reader makes of files without a line
            raise InputError(f"{source}: empty input (no columns and no rows)")
    roles = (("user", user_col, USER_COLUMNS, True), ("item", item_col, ITEM_COLUMNS, True),
             ("timestamp", time_col, TIME_COLUMNS, True), ("rating", rating_col, RATING_COLUMNS, False))
    chosen: dict[str, tuple[str | None, str]] = {}
    for file, columns in files:
        where = source if file == local_path(source) else file
        for role, explicit, candidates, required in roles:
            name = pick_column(columns, where, role, explicit, candidates, required=required)
            first_name, first_file = chosen.setdefault(role, (name, file))
            if name != first_name:
                # Spark reads one file's schema and gives the others' differently named column as
                # null: thousands of "null item" rows that name neither file nor spelling.
                raise InputError(f"{source}: its files name the {role} column differently: {first_file} has "
                                 f"{_spelt(first_name)}, {file} has {_spelt(name)}; every file needs the same "
                                 "column names")
    if fmt != "parquet":
        first_file, first_columns = files[0] if files else ("", [])
        for file, columns in files:
            if columns != first_columns:
                raise InputError(f"{source}: {file} has columns {', '.join(columns)} where {first_file} has "
                                 f"{', '.join(first_columns)}: Spark reads every CSV file of a folder by the first "
                                 "one's header, column by column")
    if empty:
        raise InputError(f"{source}: empty input (zero rows)")


def _spelt(column: str | None) -> str:
    return repr(column) if column is not None else "none"


def check_user_table(path: str, feature_cols: list[str] | None = None) -> None:
    """The user table (``--user-features``): exists; for Parquet, readable footers with a
    user column and every named feature column."""
    local = local_path(path)
    if local is None:
        return
    if not os.path.exists(local):
        raise InputError(f"{path}: path does not exist")
    if not os.path.isdir(local) and format_from_name(path) != "parquet":
        return
    scanned = parquet_footers(path)
    if scanned is None:
        return
    for file, columns in scanned[0]:
        where = path if file == local else file
        pick_column(columns, where, "user", None, USER_COLUMNS, required=True)
        for name in feature_cols or ():
            pick_column(columns, where, "user feature", name, (), required=True)


def check_parquet_columns(path: str, required: tuple[str, ...], what: str, hint: str) -> None:
    """A local Parquet file or dataset whose every data file has the ``required`` columns;
    the message names the file and the first missing column, then ``hint``."""
    scanned = parquet_footers(path, what, hint)
    if scanned is None:
        return
    for file, columns in scanned[0]:
        missing = [c for c in required if c not in columns]
        if missing:
            raise InputError(f"{what}{file} lacks column {missing[0]!r} (has {', '.join(columns)}); {hint}")
