"""Cursor paging (`server.http.common.paging`), exactly: OpenAI's `after`, Anthropic's `after_id`
and
`before_id`."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from server.http.common.errors import APIError
from server.http.common.paging import page

ITEMS = [SimpleNamespace(id=name) for name in "abcde"]


def ids(result):
    items = result["data"]
    assert (result["first_id"], result["last_id"]) == (
        (items[0].id, items[-1].id) if items else (None, None))
    return "".join(item.id for item in items), result["has_more"]


@pytest.mark.parametrize("limit,after,before,expected", [
    (20, None, None, ("abcde", False)),
    (2, None, None, ("ab", True)),
    (5, None, None, ("abcde", False)),
    (2, "b", None, ("cd", True)),
    (3, "b", None, ("cde", False)),
    (2, "e", None, ("", False)),
    (2, None, "d", ("bc", True)),
    (3, None, "d", ("abc", False)),
    (2, None, "a", ("", False)),
])
def test_pages(limit, after, before, expected):
    assert ids(page(ITEMS, limit, after=("after_id", after), before=("before_id", before))) \
        == expected


def test_an_unknown_cursor_is_a_400_naming_its_parameter():
    for cursors in ({"after": ("after", "z")}, {"before": ("before_id", "z")}):
        with pytest.raises(APIError) as err:
            page(ITEMS, 2, **cursors)
        name = next(iter(cursors.values()))[0]
        assert (err.value.status, err.value.param) == (400, name)
