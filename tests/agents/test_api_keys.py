"""`agents.api_keys`: the one reader of the keys that name users (the proxy's and the Tinker
server's), on hand-written entries and a keys file made in the test."""

from __future__ import annotations

import pytest

from agents.api_keys import read_keys, user_of_key


def test_entries_and_a_keys_file_give_each_key_its_user(tmp_path):
    keys_file = tmp_path / "keys"
    keys_file.write_text("# users\n\nalice  tml-a2\n  bob tml-b\ntml-solo\n")
    users = read_keys(["alice tml-a1", "tml-x"], keys_file)
    assert users == {
        "tml-a1": "alice",
        "tml-x": user_of_key("tml-x"),
        "tml-a2": "alice",
        "tml-b": "bob",
        "tml-solo": user_of_key("tml-solo"),
    }
    assert user_of_key("tml-x") == user_of_key("tml-x") != user_of_key("tml-y")
    assert user_of_key("tml-x").startswith("key-") and "tml" not in user_of_key("tml-x")


@pytest.mark.parametrize(
    "entry, message",
    [
        ("", "an empty key"),
        ("a b c", "KEY or USER KEY, got 3 words"),
        ("local tml-k", "not 'local'"),
        (f"{user_of_key('z')} tml-k", "key-<16 hex digits>"),
        ("-dash tml-k", "starting with a letter"),
        ("alice tml-\u00e9", "printable ASCII"),
    ],
)
def test_a_malformed_entry_is_refused_without_echoing_the_key(entry, message):
    with pytest.raises(ValueError, match=message) as refused:
        read_keys([entry], setting="serve.api_keys")
    assert str(refused.value).startswith("serve.api_keys:")
    assert "tml-k" not in str(refused.value)


def test_a_key_naming_two_users_or_an_unreadable_file_is_refused(tmp_path):
    with pytest.raises(ValueError, match="a key names both 'alice' and 'bob'"):
        read_keys(["alice tml-k", "bob tml-k"])
    assert read_keys(["alice tml-k", "alice tml-k"]) == {"tml-k": "alice"}
    with pytest.raises(ValueError, match="cannot read"):
        read_keys([], tmp_path / "missing")
