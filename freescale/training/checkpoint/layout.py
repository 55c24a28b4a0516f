"""A checkpoint folder's layout, read without torch (the launcher reads it before any rank starts).

``<folder>/step_<n>/`` holds DCP's files, ``rank_<r>.pt`` per rank (what only that rank knows),
``SHARDS``, ``CONFIG`` and ``COMPLETE``, written last; ``<folder>/LOCK`` while a job trains."""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

COMPLETE = "COMPLETE"
SHARDS = "SHARDS"
CONFIG = "CONFIG"
LOCK = "LOCK"
STEP_DIR = re.compile(r"^step_(\d+)$")
OWN_FILE = re.compile(r"^rank_(\d+)\.pt$")


def own_file(step_dir: Path, rank: int) -> Path:
    return step_dir / f"rank_{rank}.pt"


def complete_steps(folder: Path | None) -> list[int]:
    """Steps of the complete checkpoints in ``folder``, oldest first."""
    if folder is None or not folder.is_dir():
        return []
    return sorted(int(m.group(1)) for p in folder.iterdir()
                  if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).exists())


def saved_world_size(step_dir: Path) -> int:
    """How many ranks wrote the checkpoint: one own file each."""
    return sum(1 for p in step_dir.iterdir() if OWN_FILE.match(p.name))


def saved_config(step_dir: Path) -> dict[str, Any]:
    """The run's flat config as the checkpoint recorded it ({} before CONFIG was recorded)."""
    path = step_dir / CONFIG
    return json.loads(path.read_text()) if path.exists() else {}


def saved_shards(step_dir: Path) -> str | None:
    """The SHA-256 of the manifest the checkpoint trained on (None where not recorded)."""
    path = step_dir / SHARDS
    return path.read_text().strip() if path.exists() else None


def other_shards(step_dir: Path, recorded: str, shards_sha256: str) -> str:
    """The refusal of a resume in shards other than the ones checkpoint ``step_dir`` trained on."""
    return (f"checkpoint {step_dir} was written for other shards (manifest sha256 {recorded[:12]}..., these are "
            f"{shards_sha256[:12]}...): use another checkpoint.folder, or remove this one to start over")
