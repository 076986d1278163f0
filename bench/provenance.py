"""Where a benchmark's result comes from: the commit of the tree it ran on (results name it beside the date), and
the source it imports."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tree() -> str:
    """The short commit of the repository's HEAD ('' outside a git checkout or without git)."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=ROOT).stdout.strip()
    except OSError:
        return ""


def use_tree_source() -> None:
    """Import cobatch from this tree's src, after the entries of PYTHONPATH and before the installed packages: the
    tree's code by default, another tree's where PYTHONPATH names it (the two sides of an A/B of sources, one call)."""
    src = os.path.abspath(ROOT / "src")
    if any(os.path.abspath(p) == src for p in sys.path if p):
        return
    named = {os.path.abspath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
    at = max((i + 1 for i, p in enumerate(sys.path) if p and os.path.abspath(p) in named), default=1)
    sys.path.insert(at, src)
