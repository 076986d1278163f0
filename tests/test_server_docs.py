"""docs/server.md lists every flag and endpoint: its generated tables match the code (regenerate with
`python3 scripts/server_docs.py`)."""

from __future__ import annotations

import argparse
import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "server.md"


def _generator():
    spec = importlib.util.spec_from_file_location("server_docs", ROOT / "scripts" / "server_docs.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_server_md_is_current():
    text = DOC.read_text()
    assert _generator().render(text) == text, "docs/server.md is stale: run python3 scripts/server_docs.py"


def test_every_serve_flag_is_in_docs_server_md():
    from cobatch.cli import build_parser
    commands = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    serve = commands.choices["serve"]
    names = [name for action in serve._actions for name in action.option_strings
             if action.help != argparse.SUPPRESS and name not in ("-h", "--help")]
    assert len(names) > 40
    text = DOC.read_text()
    assert [name for name in names if f"`{name}`" not in text] == []


def test_every_route_is_in_docs_server_md():
    # read the route decorators with a regex, independently of the generator's ast walk
    paths = set()
    for source in (ROOT / "src" / "cobatch" / "server").glob("*.py"):
        paths.update(re.findall(r'^\s*@\w+\.(?:get|post)\("(/[^"]*)"', source.read_text(), re.M))
    assert {"/v1/chat/completions", "/v1/messages", "/health", "/completion"} <= paths
    text = DOC.read_text()
    assert sorted(path for path in paths if f"`{path}`" not in text) == []
