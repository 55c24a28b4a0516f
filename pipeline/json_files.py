"""Writing the calibration's JSON files (cost model, rank speeds) whole or not at all.

The balance job reads these files, possibly while a calibration is rewriting
them; writing a temporary sibling and renaming it into place means a reader
sees the old file or the new one, never half of one. One function, so both
files have the same text layout (2-space indent, final newline).
"""
from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


def write_json(path: str | Path, data: dict) -> str:
    """Write indented JSON atomically (temporary sibling, then rename); parents are created; returns the text."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(data, indent=2) + "\n"
    with tempfile.NamedTemporaryFile("w", dir=p.parent, prefix=f".{p.name}.", suffix=".tmp", delete=False) as tmp:
        tmp.write(text)
    os.replace(tmp.name, p)
    return text
