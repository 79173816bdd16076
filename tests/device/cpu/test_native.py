"""The native library's build: it builds here, and every source it needs is listed and hashed."""

from __future__ import annotations

import re
from importlib import resources

from kvledger.device.cpu import native


def test_native_kernel_builds_here():
    """g++ is part of this project's machines; the fallback is tested by the torch backend."""
    assert native.load() is not None


def test_every_source_is_listed_once_and_every_included_header_is_a_source():
    """The build writes only ``native.SOURCES`` into its folder, side by side, and hashes them
    into its key: every file of ``csrc/`` and every file a source includes with quotes must be
    listed, under one name."""
    folder = resources.files("kvledger.device.cpu").joinpath("csrc")
    assert len(set(native.SOURCES)) == len(native.SOURCES)
    assert {f.name for f in folder.iterdir() if f.name.endswith((".cpp", ".h"))} == set(
        native.SOURCES)
    for name in native.SOURCES:
        text = folder.joinpath(name).read_text()
        assert set(re.findall(r'^#include "([^"]+)"', text, re.MULTILINE)) <= set(
            native.SOURCES), name
