"""docs/architecture.md's layout table has one row per package folder of ``kvledger/`` (a folder
holding Python modules), and no row for a folder that is gone."""

from __future__ import annotations

import re
from pathlib import Path

import kvledger

PACKAGE_DIR = Path(kvledger.__file__).resolve().parent
DOC = PACKAGE_DIR.parent / "docs" / "architecture.md"


def _rows(text: str) -> list[str]:
    """The path cells of the table under ``## Layout`` (``kvledger/x/y/`` as written)."""
    section = text.split("## Layout", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"^\| `(kvledger/[^`]*)` \|", section, re.MULTILINE)


def _package_folders() -> set[str]:
    return {f"{p.parent.relative_to(PACKAGE_DIR.parent).as_posix()}/"
            for p in PACKAGE_DIR.rglob("*.py") if p.parent != PACKAGE_DIR}


def test_the_row_reader_reads_a_table():
    text = "## Layout\n\n| Path | One concept |\n| --- | --- |\n| `kvledger/a/` | A. |\n" \
           "| `kvledger/b/c/` | C. |\n\n## Next\n| `kvledger/d/` | not layout |\n"
    assert _rows(text) == ["kvledger/a/", "kvledger/b/c/"]


def test_every_package_folder_has_one_row_and_every_row_a_folder():
    rows = _rows(DOC.read_text())
    assert len(rows) == len(set(rows)), "a folder has two rows"
    folders = _package_folders()
    missing, gone = sorted(folders - set(rows)), sorted(set(rows) - folders)
    assert not missing, f"package folders without a row in docs/architecture.md: {missing}"
    assert not gone, f"rows of docs/architecture.md for folders that are gone: {gone}"
