"""`cobatch serve --config FILE.yaml`: the same flags from a YAML mapping, as vLLM's --config takes them.

Keys are flag names without the dashes (max_num_seqs or max-num-seqs); true switches a flag on, a list repeats
it. The file's flags go first, so a flag given on the command line wins.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from cobatch.errors import UserError


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with `--config FILE` replaced by the flags the file holds (placed before the others)."""
    rest, path = [], None
    it = iter(argv)
    for arg in it:
        if arg == "--config":
            path = next(it, None)
            if path is None:
                raise UserError("--config needs a file")
        elif arg.startswith("--config="):
            path = arg.split("=", 1)[1]
        else:
            rest.append(arg)
    if path is None:
        return argv
    return rest[:1] + _flags(path, parser) + rest[1:]


def _flags(path: str, parser: argparse.ArgumentParser) -> list[str]:
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_text())
    except OSError as exc:
        raise UserError(f"--config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise UserError(f"--config {path}: unknown key {key!r} (no flag {flag})")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            for item in value:
                flags += [flag, str(item)]
        elif value is not None:
            flags += [flag, str(value)]
    return flags
