"""Key files (``--api-keys-file``): whole trimmed lines, '#' lines are comments, no fail-open."""

from __future__ import annotations

import pytest

from kvledger.errors import InvalidParameterError
from kvledger.server.auth.api_keys import parse_key_file, read_api_keys


def test_a_hash_inside_a_key_is_part_of_it():
    assert parse_key_file("sk-abc#SECRET\n", "f") == ["sk-abc#SECRET"]


def test_lines_are_trimmed_and_comment_lines_skipped():
    text = "# tenants\n\n  key-one  \n\t# key-two was revoked\nkey-three\r\n"
    assert parse_key_file(text, "f") == ["key-one", "key-three"]


@pytest.mark.parametrize("text", ["", "\n\n", "# only a comment\n", "   # indented\n  \n"])
def test_a_file_without_keys_is_refused(text):
    with pytest.raises(InvalidParameterError, match="holds no API key"):
        parse_key_file(text, "--api-keys-file keys.txt")


@pytest.mark.parametrize(("key", "why"), [("", "empty"), ("   ", "empty"),
                                           ("#hash-first", "must not start with '#'"),
                                           (" padded", "whitespace")])
def test_a_key_a_file_could_not_hold_is_refused_on_the_command_line(key, why):
    with pytest.raises(InvalidParameterError, match=why):
        read_api_keys([key], None)
    with pytest.raises(InvalidParameterError, match=why):
        read_api_keys([], None, [key])


def test_keys_from_options_and_file_and_admin_keys(tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("file-key\n")
    keys = read_api_keys(["cli-key"], str(path), ["admin-key"])
    assert keys.keys == ("cli-key", "file-key") and keys.admin_keys == ("admin-key",)
    assert "2 API keys and 1 admin keys" in keys.describe()
    with pytest.raises(InvalidParameterError, match="also given"):
        read_api_keys(["same"], None, ["same"])


def test_a_key_file_works_end_to_end(make_client, tmp_path):
    path = tmp_path / "keys.txt"
    path.write_text("# comment\nsk-abc#SECRET\n")
    client = make_client(api_key=list(read_api_keys([], str(path)).keys))
    ok = client.get("/v1/models", headers={"Authorization": "Bearer sk-abc#SECRET"})
    cut = client.get("/v1/models", headers={"Authorization": "Bearer sk-abc"})
    assert ok.status_code == 200 and cut.status_code == 401


def test_a_byte_order_mark_is_dropped_from_a_key_file(tmp_path):
    """Old code: the first key was stored as "\\ufeffsk-first" and never matched."""
    path = tmp_path / "keys.txt"
    path.write_bytes("sk-first\nsk-second\n".encode("utf-8-sig"))
    assert read_api_keys([], str(path)).keys == ("sk-first", "sk-second")
    assert parse_key_file("\ufeff# tenants\nsk-a\n", "f") == ["sk-a"]


@pytest.mark.parametrize("bad", ["\x00", "\x1b", "\x7f", "\u200b", "\ufeff"])
def test_a_key_with_an_invisible_character_is_refused_naming_its_line(bad, tmp_path):
    """Old code accepted a NUL (or any control) inside a key."""
    path = tmp_path / "keys.txt"
    path.write_text(f"# tenants\nsk-good\nsk-{bad}bad\n", encoding="utf-8")
    with pytest.raises(InvalidParameterError,
                       match=rf"keys.txt line 3: .*U\+{ord(bad):04X}"):
        read_api_keys([], str(path))
    with pytest.raises(InvalidParameterError, match=rf"--api-key: .*U\+{ord(bad):04X}"):
        read_api_keys([f"sk-{bad}bad"], None)
