"""The documents name what the code has: every CLI option (read from the commands themselves,
not from `--help` text, which rich cuts to the terminal's width), every environment variable
the code reads, and every local link resolves."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import typer
from typer.testing import CliRunner

from kvledger.cli import app

ROOT = Path(__file__).resolve().parents[1]
CLI_MD = ROOT / "docs" / "cli.md"
SHARED = "Engine options"  # the section every engine-building command points to


def commands(cmd=None, path=()):
    """(path, click command) for every leaf command, e.g. (("eval", "passkey"), cmd)."""
    cmd = cmd or typer.main.get_command(app)
    if hasattr(cmd, "commands"):
        for name, sub in sorted(cmd.commands.items()):
            yield from commands(sub, (*path, name))
    else:
        yield path, cmd


def option_names(cmd) -> list[str]:
    return [name for p in cmd.params if p.param_type_name == "option"
            for name in (*p.opts, *p.secondary_opts)]


def sections(text: str) -> dict[str, str]:
    """Heading text of each ``## `` section (backticks dropped) -> its body."""
    parts = re.split(r"^## (.+)$", text, flags=re.MULTILINE)
    return {head.strip().strip("`"): body for head, body in zip(parts[1::2], parts[2::2],
                                                                 strict=True)}


ALL = list(commands())


def test_every_command_is_found():
    names = {" ".join(path) for path, _ in ALL}
    assert {"generate", "serve", "plan", "eval perplexity", "replay"} <= names


@pytest.mark.parametrize("path,cmd", ALL, ids=[" ".join(p) for p, _ in ALL])
def test_every_option_is_in_its_section_of_cli_md(path, cmd):
    result = CliRunner().invoke(app, [*path, "--help"])
    assert result.exit_code == 0, result.output
    docs = sections(CLI_MD.read_text())
    title = "kvledger " + " ".join(path)
    assert title in docs, f"docs/cli.md has no section '## `{title}`'"
    text = docs[title] + docs[SHARED]
    missing = [o for o in option_names(cmd) if f"`{o}`" not in text]
    assert not missing, f"{title}: options missing from docs/cli.md: {missing}"


def test_root_options_are_documented():
    text = CLI_MD.read_text()
    root = typer.main.get_command(app)
    assert [o for o in option_names(root) if f"`kvledger {o}`" not in text] == []


def documents() -> list[Path]:
    return [ROOT / "README.md", ROOT / "BENCHMARKS.md", *sorted((ROOT / "docs").rglob("*.md")),
            *sorted((ROOT / "benchmarks").rglob("*.md"))]


def anchors(doc: Path) -> set[str]:
    """GitHub's anchors of a Markdown file's headings (outside code blocks): lower case,
    punctuation but ``-`` and ``_`` dropped, spaces as ``-``, repeats numbered."""
    text = re.sub(r"^```.*?^```", "", doc.read_text(), flags=re.MULTILINE | re.DOTALL)
    found, seen = set(), {}
    for heading in re.findall(r"^#{1,6} (.+)$", text, flags=re.MULTILINE):
        slug = re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")
        found.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return found


def test_local_anchors_resolve():
    broken = []
    for doc in documents():
        for target, anchor in re.findall(r"\]\(([^)#\s]*)#([^)\s]+)\)", doc.read_text()):
            path = doc.parent / target if target else doc
            if "://" in target or path.suffix != ".md" or not path.exists():
                continue
            if anchor not in anchors(path):
                broken.append(f"{doc.relative_to(ROOT)} -> {target}#{anchor}")
    assert broken == []


def test_every_environment_variable_the_code_reads_is_documented():
    named = set()
    for source in (ROOT / "kvledger").rglob("*.py"):
        named |= set(re.findall(r"KVLEDGER_[A-Z0-9_]*[A-Z0-9]", source.read_text()))
    assert "KVLEDGER_CACHE" in named  # the search itself works
    text = "\n".join(p.read_text() for p in documents())
    assert sorted(v for v in named if f"`{v}" not in text) == []


def test_local_links_resolve():
    broken = []
    for doc in documents():
        for target in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", doc.read_text()):
            if "://" in target or target.startswith("mailto:"):
                continue
            if not (doc.parent / target).exists():
                broken.append(f"{doc.relative_to(ROOT)} -> {target}")
    assert broken == []
