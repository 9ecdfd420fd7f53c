"""Cursor paging of a list endpoint (OpenAI's `after`, Anthropic's `after_id`/`before_id`): the
page of `limit` items after, or before, the item with a given id, as the fields both APIs' list
bodies share (`data`, `first_id`, `last_id`, `has_more`)."""

from __future__ import annotations

from collections.abc import Sequence

from server.http.common.errors import APIError


def page(items: Sequence, limit: int, *, after: tuple[str, str | None] = ("after", None),
         before: tuple[str, str | None] = ("before", None)) -> dict:
    """The page's list fields (`has_more`: whether more items lie beyond it); `after`/`before`:
    (the query parameter's name, the id it gives or None). An id not among the items is a 400
    naming the parameter."""
    ids = [item.id for item in items]
    for name, cursor in (after, before):
        if cursor is not None and cursor not in ids:
            raise APIError(400, f"{name}: no item with id {cursor!r} in this list", param=name,
                           code="invalid_value", redact=False)
    items = list(items)
    if before[1] is not None:
        items = items[:ids.index(before[1])]
        return _fields(items[-limit:], len(items) > limit)
    if after[1] is not None:
        items = items[ids.index(after[1]) + 1:]
    return _fields(items[:limit], len(items) > limit)


def _fields(page: list, has_more: bool) -> dict:
    return {"data": page, "has_more": has_more, "first_id": page[0].id if page else None,
            "last_id": page[-1].id if page else None}
