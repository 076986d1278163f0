"""`cobatch serve --config FILE.yaml` (and run-batch's): the same flags from a YAML mapping, as vLLM's --config takes
them.

Keys are flag names without the dashes (max_num_seqs or max-num-seqs); true switches a flag on, a list repeats
it, a mapping is the JSON a flag takes (chat_template_kwargs: {enable_thinking: false}). A flag given on the command
line wins: the file's value of it is left out.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cobatch.errors import UserError


def expand_config(argv: list[str], parser: argparse.ArgumentParser) -> list[str]:
    """argv with `--config FILE` replaced by the flags the file holds (placed before the others)."""
    rest, paths = [], []
    it = iter(argv)
    for arg in it:
        if arg == "--config" or arg.startswith("--config="):
            path = next(it, None) if arg == "--config" else arg.split("=", 1)[1]
            if not path:
                raise UserError("--config needs a file")
            paths.append(path)
        else:
            rest.append(arg)
    if not paths:
        return argv
    if len(paths) > 1:
        raise UserError(f"--config: one file, not {len(paths)}")
    actions = {opt: action for action in parser._actions for opt in action.option_strings}
    given = {actions[arg.split("=", 1)[0]].dest for arg in rest if arg.split("=", 1)[0] in actions}
    return rest[:1] + _flags(paths[0], actions, given) + rest[1:]


def _flags(path: str, actions: dict[str, argparse.Action], given: set[str]) -> list[str]:
    """The flags the file holds, but those whose option the command line sets (`given`: their dests)."""
    import yaml
    try:
        data = yaml.safe_load(Path(path).read_bytes())
    except OSError as exc:
        raise UserError(f"--config: cannot read {path}: {exc.strerror}") from None
    except yaml.YAMLError as exc:
        raise UserError(f"--config {path}: not YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return []
    if not isinstance(data, dict):
        raise UserError(f"--config {path}: expected a mapping of flag names to values")
    flags: list[str] = []
    for key, value in data.items():
        flag = "--" + str(key).replace("_", "-")
        action = actions.get(flag)
        if action is None or flag == "--config":
            raise UserError(f"--config {path}: unknown key {key!r} (no flag {flag})")
        if action.dest in given:
            continue
        if action.nargs == 0 and not isinstance(value, bool):     # a switch: not a value the next flag would take
            raise UserError(f"--config {path}: {key}: true or false (got {value!r})")
        if isinstance(value, bool):
            if value:
                flags.append(flag)
            elif isinstance(action, argparse.BooleanOptionalAction):
                flags.append("--no-" + flag[2:])
        elif isinstance(value, list):
            if not (isinstance(action, argparse._AppendAction) or action.nargs in ("+", "*")):
                raise UserError(f"--config {path}: {key}: one value, not a list")
            for item in value:
                flags += [flag, *(map(_text, item) if isinstance(item, list) else [_text(item)])]
        elif value is not None:
            flags += [flag, _text(value)]
    return flags


def _text(value) -> str:
    """A YAML value as the command line gives it: a mapping as JSON (the flags that take JSON), the rest as text."""
    return json.dumps(value) if isinstance(value, dict) else str(value)
