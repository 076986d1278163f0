"""Where a benchmark's result comes from: the commit of the tree it ran on (results name it beside the date)."""

from __future__ import annotations

import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree() -> str:
    """The short commit of the repository's HEAD ('' outside a git checkout or without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    except OSError:
        return ""
