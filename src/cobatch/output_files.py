"""The files commands write (run-batch's answers, make-model's GGUF): the path checked before the work starts, the
file written as NAME.partial and renamed when whole, so a failed or interrupted run leaves no file that looks
complete and keeps the one that was there."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from cobatch.errors import UserError


def check_output_path(path: str | os.PathLike, what: str, source: str | os.PathLike | None = None) -> Path:
    """`path` if a file can be written there (and it is not `source`, the file the command reads), else a
    UserError starting with `what` (the flag or argument that named it)."""
    path = Path(path)
    if path.is_dir():
        raise UserError(f"{what} {path}: is a directory")
    if not path.parent.is_dir():
        raise UserError(f"{what} {path}: no such directory {path.parent}")
    if source is not None and path.exists() and Path(source).exists() and os.path.samefile(source, path):
        raise UserError(f"{what} {path}: is the input file")
    if not os.access(path.parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise UserError(f"{what} {path}: not writable")
    return path


@contextmanager
def partial_file(path: Path) -> Iterator[Path]:
    """PATH.partial to write in the block: renamed to `path` when the block ends, removed if it raises."""
    partial = path.with_name(path.name + ".partial")
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise
