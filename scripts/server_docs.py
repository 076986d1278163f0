#!/usr/bin/env python3
"""Regenerate the flag and endpoint tables of docs/server.md from the code.

The flags come from cobatch.cli's argparse parser (every subcommand), the endpoints from the route decorators
(`@router.post("/path")`, `@app.get("/path")`) in src/cobatch/server/. Only the text between the
`<!-- generated: NAME -->` and `<!-- end: NAME -->` markers is rewritten; the prose around them is written by hand.

    python3 scripts/server_docs.py            rewrite docs/server.md
    python3 scripts/server_docs.py --check    exit 1 if docs/server.md is not current
"""

from __future__ import annotations

import argparse
import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "server.md"
SERVER_SRC = ROOT / "src" / "cobatch" / "server"
sys.path.insert(0, str(ROOT / "src"))


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def flag_table(parser: argparse.ArgumentParser, leave_out: frozenset[str] = frozenset()) -> str:
    """The parser's flags, but those whose names are in leave_out."""
    rows = ["| flag | default | what it does |", "| --- | --- | --- |"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) or action.help == argparse.SUPPRESS:
            continue
        if set(action.option_strings or [action.dest]) <= leave_out:
            continue
        names = ", ".join(f"`{name}`" for name in action.option_strings) or f"`{action.dest}` (positional)"
        if action.option_strings and action.nargs != 0 and action.metavar is not None:
            names += f" {action.metavar}"
        default = "" if action.default in (None, False, argparse.SUPPRESS) else f"`{action.default}`"
        if action.choices:
            default += (" " if default else "") + "(" + " / ".join(map(str, action.choices)) + ")"
        rows.append(f"| {names} | {default} | {_cell((action.help or '').replace('%%', '%'))} |")
    return "\n".join(rows)


def command_sections(parser: argparse.ArgumentParser, prog: str) -> list[str]:
    """A section per subcommand of parser (recursively), each with its flag table."""
    commands = next((a for a in parser._actions if isinstance(a, argparse._SubParsersAction)), None)
    if commands is None:
        return []
    helps = {choice.dest: choice.help for choice in commands._choices_actions}
    serve = commands.choices.get("serve")
    serve_flags = frozenset(n for a in serve._actions for n in (a.option_strings or [a.dest])) if serve else frozenset()
    parts = []
    for name, sub in commands.choices.items():
        if name == "make-model":      # its flags belong to the writer's own parser
            from cobatch.testing.gguf_writer import build_parser as writer_parser
            sub = writer_parser(f"{prog} {name}")
        parts.append(f"### `{prog} {name}`\n\n{_cell(helps.get(name) or sub.description or '')}")
        if name == "run-batch":       # serve's flags and its own
            parts[-1] += f"\n\nEvery flag of `{prog} serve`, and:\n\n" + flag_table(sub, serve_flags)
        elif any(not isinstance(a, (argparse._HelpAction, argparse._SubParsersAction)) for a in sub._actions):
            parts[-1] += "\n\n" + flag_table(sub)
        parts += command_sections(sub, f"{prog} {name}")
    return parts


def flags_section() -> str:
    from cobatch.cli import build_parser
    return "\n\n".join(command_sections(build_parser(), "cobatch"))


def routes() -> list[tuple[str, str, str]]:
    """(method, path, module) for every route decorator in the server package, in file order."""
    found = []
    for path in sorted(SERVER_SRC.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for deco in node.decorator_list:
                if (isinstance(deco, ast.Call) and isinstance(deco.func, ast.Attribute)
                        and deco.func.attr in ("get", "post", "put", "delete") and deco.args
                        and isinstance(deco.args[0], ast.Constant) and str(deco.args[0].value).startswith("/")):
                    found.append((deco.func.attr.upper(), deco.args[0].value, f"server/{path.name}"))
    return sorted(found, key=lambda r: (r[1], r[0]))


def endpoints_section() -> str:
    rows = ["| method | path | served by |", "| --- | --- | --- |"]
    rows += [f"| {method} | `{path}` | `{module}` |" for method, path, module in routes()]
    return "\n".join(rows)


SECTIONS = {"flags": flags_section, "endpoints": endpoints_section}


def render(text: str) -> str:
    for name, make in SECTIONS.items():
        pattern = re.compile(rf"(<!-- generated: {name} -->\n).*?(<!-- end: {name} -->)", re.S)
        if not pattern.search(text):
            raise SystemExit(f"{DOC}: no <!-- generated: {name} --> ... <!-- end: {name} --> markers")
        text = pattern.sub(lambda m: m.group(1) + make() + "\n" + m.group(2), text)
    return text


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--check", action="store_true", help="exit 1 if docs/server.md is not current")
    args = ap.parse_args(argv)
    current = DOC.read_text()
    wanted = render(current)
    if args.check:
        if wanted != current:
            print(f"{DOC.relative_to(ROOT)} is out of date: run python3 scripts/server_docs.py", file=sys.stderr)
            return 1
        return 0
    DOC.write_text(wanted)
    return 0


if __name__ == "__main__":
    sys.exit(main())
