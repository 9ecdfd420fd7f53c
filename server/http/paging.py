"""Cursor paging of a list endpoint (OpenAI's `after`, Anthropic's `after_id`/`before_id`): the
page of `limit` items after, or before, the item with a given id."""

from __future__ import annotations

from collections.abc import Sequence

from server.http.errors import APIError


def page(items: Sequence, limit: int, *, after: tuple[str, str | None] = ("after", None),
         before: tuple[str, str | None] = ("before", None)) -> tuple[list, bool]:
    """(the page, whether more items lie beyond it); `after`/`before`: (the query parameter's
    name, the id it gives or None). An id not among the items is a 400 naming the parameter."""
    ids = [item.id for item in items]
    for name, cursor in (after, before):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"{name}: no item with id {cursor!r} in this list", param=name,
                           code="invalid_value", redact=False)
    items = list(items)
    if before[1] is not None:
        items = items[:ids.index(before[1])]
        return items[-limit:], len(items) > limit
    if after[1] is not None:
        items = items[ids.index(after[1]) + 1:]
    return items[:limit], len(items) > limit
