"""The calibration's JSON files (cost model, rank speeds): written whole or not at all, read
with one-line errors.

The balance job reads these files, possibly while a calibration is rewriting
them; writing a temporary sibling and renaming it into place means a reader
sees the old file or the new one, never half of one. One writer, so both files
have the same text layout (2-space indent, final newline); one reader, so both
fail the same way.
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from freescale.runtime.errors import InputError, one_line


def write_json(path: str | Path, data: dict) -> str:
    """Write indented JSON atomically (temporary sibling, then rename); parents are created; returns the text."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2) + "\n"
    with tempfile.NamedTemporaryFile("w", dir=p.parent, prefix=f".{p.name}.", suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, p)
    return text


def read_json(path: str | Path, what: str) -> Any:
    """Parsed JSON of ``path``; a missing or unparseable file is one ``InputError`` line naming
    the file and ``what`` it should be (e.g. "cost model file")."""
    p = Path(path)
    if not p.is_file():
        raise InputError(f"{p}: {what} does not exist")
    try:
        return json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise InputError(f"{p}: not valid JSON ({one_line(err)})") from None
