"""Command outputs shown in the docs are the commands' outputs today: each ``$ kvledger plan``
/ ``$ kvledger models`` line of a code block in README.md and docs/ is run (in process, a wide
terminal) and every row it shows must be a row of the real output, cell for cell; the counts
and ids the prose quotes are checked against the catalogue. So a changed figure fails here
until the page is regenerated (paste the command's output). README's ``$ kvledger generate``
sample (slow: it loads the model) is ``make demo``'s command, and its figures that do not
depend on the machine (model, KV format and bytes, prompt tokens, the rows) are the run's; its
KV figures follow from its token counts by the ledger's formula, computed here by hand."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
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


def _blocks(page: Path, run: tuple[str, ...] = RUN) -> list[tuple[str, list[str]]]:
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
    return [(c, s) for c, s in found if c.startswith("kvledger ") and c.split()[1] in run]


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


# SmolLM2-135M's KV in bf16: 30 layers x 3 KV heads x 64 dims x (K, V) x 2 B (its config.json)
SMOLLM2_BF16_KV_BYTES_PER_TOKEN = 30 * 3 * 64 * 2 * 2
GENERATE_FIGURES = {
    "header": r"(\S+) · (\w+) \(weights: .*\) · KV (\w+), ([\d,]+) B/token · load [\d.]+ s",
    "tokens": r"tokens (\d+) prompt \+ (\d+) output \((\w+)\)",
    "ttft": r"TTFT [\d.]+ ms",
    "tpot": r"TPOT [\d.]+ ms \([\d.]+ tok/s\)",
    "held": r"KV held \(tensors\) ([\d,]+) B in (\d+) blocks of (\d+) tokens",
    "ledger": r"KV ledger ([\d,]+) B = (\d+) tokens × ([\d,]+) B \(([\d,]+) B in whole blocks\)",
}


def _generate_figures(lines: list[str]) -> dict[str, tuple[int | str, ...]]:
    """The figures of a ``kvledger generate`` bill (wrapped or not), numbers as ints."""
    text = " ".join(" ".join(lines).split())
    figures = {}
    for name, pattern in GENERATE_FIGURES.items():
        found = re.search(pattern, text)
        assert found, f"no {name} in: {text}"
        figures[name] = tuple(int(g.replace(",", "")) if g.replace(",", "").isdigit() else g
                              for g in found.groups())
    return figures


@pytest.mark.slow
def test_readme_generate_sample_is_make_demos_run():
    ((command, shown),) = _blocks(ROOT / "README.md", ("generate",))
    demo = re.search(r"^demo:.*\n\t\$\(BIN\)/(kvledger generate .*)$",
                     (ROOT / "Makefile").read_text(), re.MULTILINE).group(1)
    assert shlex.split(command) == shlex.split(demo)
    done = subprocess.run([sys.executable, "-m", "kvledger", *shlex.split(command)[1:]],
                          cwd=ROOT, capture_output=True, text=True, timeout=900, check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    ran = _generate_figures(done.stderr.splitlines())
    figures = _generate_figures(shown)
    model, dtype, kv_dtype, per_token = figures["header"]
    assert (model, dtype, kv_dtype, per_token) == ran["header"]
    assert per_token == SMOLLM2_BF16_KV_BYTES_PER_TOKEN
    prompt, output, _ = figures["tokens"]
    assert prompt == ran["tokens"][0]
    held_tokens = prompt + output - 1  # the last token sampled has no KV yet
    blocks = -(-held_tokens // 16)
    whole = blocks * 16 * per_token
    assert figures["ledger"] == (held_tokens * per_token, held_tokens, per_token, whole)
    assert figures["held"] == (whole, blocks, 16)
    assert done.stdout.strip() and shown[0].strip()  # an answer on stdout, shown first
