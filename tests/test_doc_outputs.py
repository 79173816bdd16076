"""Command outputs shown in the docs are the commands' outputs today: each ``$ kvledger plan``
/ ``$ kvledger models`` line of a code block in README.md and docs/ is run (in process, a wide
terminal) and every row it shows must be a row of the real output, cell for cell; the counts
and ids the prose quotes are checked against the catalogue. So a changed figure fails here
until the page is regenerated (paste the command's output)."""

from __future__ import annotations

import json
import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from kvledger.cli import app
from kvledger.model.catalogue import entries

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
RUN = ("plan", "models")  # commands that need no model weights (the ledger and the catalogue)
WIDTH = 120  # the terminal width the pages show (paste outputs from COLUMNS=120)
BOX = re.compile(r"[│┃┏┓┗┛┡┩┣┫━─┳┻╇╈╋┯┷┼└┘┌┐├┤┬┴]")


def _blocks(page: Path) -> list[tuple[str, list[str]]]:
    """(command, shown output lines) of every ``$ kvledger`` line in the page's code blocks."""
    found = []
    for block in re.findall(r"^```[a-z]*\n(.*?)^```", page.read_text(), re.MULTILINE | re.DOTALL):
        command, shown = None, []
        for line in [*block.splitlines(), "$ end"]:
            if line.startswith("$ "):
                if command is not None:
                    found.append((command, shown))
                command, shown = line[2:], []
            elif command is not None:
                shown.append(line)
    return [(c, s) for c, s in found if c.startswith("kvledger ") and c.split()[1] in RUN]


def _row(line: str) -> tuple[str, ...]:
    return tuple(cell.strip() for cell in BOX.split(line) if cell.strip())


CASES = [(page, command, shown) for page in PAGES for command, shown in _blocks(page)]


@pytest.mark.parametrize(("page", "command", "shown"), CASES,
                         ids=[f"{p.name}:{c[:50]}" for p, c, _ in CASES])
def test_shown_output_is_the_commands(page, command, shown, monkeypatch):
    monkeypatch.setenv("COLUMNS", str(WIDTH))
    monkeypatch.chdir(ROOT)
    args, _, pipe = command.partition(" | ")
    result = CliRunner().invoke(app, shlex.split(args)[1:])
    out = result.output
    if pipe:  # only `jq '.a, .b'` on --json: the fields, one per line
        fields = re.findall(r"\.(\w+)", pipe)
        data = json.loads(out)
        out = "\n".join(json.dumps(data[f]) for f in fields)
    actual = {_row(line) for line in out.splitlines()}
    stale = [line for line in shown if _row(line) and line.strip() != "..."
             and _row(line) not in actual]
    assert not stale, f"{page.name}: `{command}` no longer prints:\n" + "\n".join(stale)


def test_catalogue_counts_and_ids_quoted_in_planning_md():
    text = (ROOT / "docs" / "planning.md").read_text()
    shipped = int(re.search(r"ships (\d+) real configs", text).group(1))
    assert shipped == len(entries())
    ids = {e.model_id for e in entries()}
    quoted = re.findall(r'"model": "([^"]+)"', text)
    assert quoted and set(quoted) <= ids, quoted
