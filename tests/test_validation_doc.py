"""``docs/validation.md`` holds exactly the range tables the code declares (made by
``tests/validation_table.py``), so the page cannot drift from the checks."""

from __future__ import annotations

import pytest
from validation_table import DOC, TABLES, block


@pytest.mark.parametrize("name", sorted(TABLES))
def test_the_page_holds_the_codes_table(name):
    assert block(name, DOC.read_text()) == TABLES[name](), (
        f"docs/validation.md's {name} table is stale: run PYTHONPATH=. python "
        "tests/validation_table.py")
