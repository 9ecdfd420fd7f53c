"""The Responses API's store: finished responses by id, for `GET /v1/responses/{id}` and for
`previous_response_id`, bounded (least recently used first out), in memory and, with
`server.state_dir`, on disk too (`state_db.StateDB`), so they survive restarts."""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from pydantic import TypeAdapter, ValidationError

from api_schemas.responses import ResponseItem, ResponseObject
from server.http.common.errors import APIError
from server.http.jobs.state_db import StateDB

log = logging.getLogger(__name__)
T = TypeVar("T")
ITEMS = TypeAdapter(list[ResponseItem])


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: tuple[ResponseItem, ...]  # what `input_items` lists: the input history's items

    def context(self) -> list[ResponseItem]:
        """The items a response that follows this one starts from: its input and its output."""
        return [*self.items, *self.response.output]


class BoundedStore(Generic[T]):
    """Entries by id: the last `max_entries` used (least recently used out first); 0 keeps
    none. In memory until a restart, or with a `StateDB` written through to it and read back
    when made (in the order they were last stored)."""

    kind = "entries"  # what the 404 says is kept, and the records' kind in the StateDB

    def __init__(self, max_entries: int, db: StateDB | None = None):
        self.max_entries = max_entries
        self._db = db
        self._entries: OrderedDict[str, T] = OrderedDict()
        if db is not None:
            self._restore()

    def _encode(self, entry: T) -> Any:
        raise NotImplementedError

    def _decode(self, value: Any) -> T:
        raise NotImplementedError

    def _put(self, key: str, entry: T) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        self._save(key)
        self._trim()

    def _save(self, key: str) -> None:
        """Write the entry through (after a change to it)."""
        if self._db is not None:
            self._db.put(self.kind, key, self._encode(self._entries[key]), touch=True)

    def _trim(self) -> None:
        while len(self._entries) > max(self.max_entries, 0):
            key, _ = self._entries.popitem(last=False)
            if self._db is not None:
                self._db.delete(self.kind, key)

    def _restore(self) -> None:
        for key, value in self._db.load(self.kind):
            try:
                self._entries[key] = self._decode(value)
            except (ValidationError, KeyError, TypeError) as e:
                log.warning("server.state_dir: stored %s %s is unreadable (%s); dropped",
                            self.kind, key, e)
                self._db.delete(self.kind, key)
        self._trim()
        if self._entries:
            log.info("server.state_dir: %d %s restored", len(self._entries), self.kind)

    def _get(self, key: str, missing: Callable[[], APIError]) -> T:
        """The entry, or `missing()` (a 404) for an id never stored, deleted, or evicted."""
        entry = self._entries.get(key)
        if entry is None:
            raise missing()
        self._entries.move_to_end(key)
        return entry

    def kept(self) -> str:
        if self._db is not None:
            return f"{self.kind} are kept, the last {self.max_entries}"
        return (f"{self.kind} are kept in memory, the last {self.max_entries}, until a"
                " restart")

    def delete(self, key: str) -> None:
        self.get(key)
        del self._entries[key]
        if self._db is not None:
            self._db.delete(self.kind, key)

    def get(self, key: str, *, param: str | None = None) -> T:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._entries)


class ResponseStore(BoundedStore[StoredResponse]):
    kind = "responses"

    def put(self, response: ResponseObject, items: list[ResponseItem]) -> None:
        self._put(response.id, StoredResponse(response, tuple(items)))

    def _encode(self, entry: StoredResponse) -> dict:
        return {"response": entry.response.model_dump(mode="json"),
                "items": ITEMS.dump_python(list(entry.items), mode="json")}

    def _decode(self, value: dict) -> StoredResponse:
        return StoredResponse(ResponseObject.model_validate(value["response"]),
                              tuple(ITEMS.validate_python(value["items"])))

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        what = "Previous response" if param else "Response"
        return self._get(response_id, lambda: APIError(
            404, f"{what} with id {response_id!r} not found ({self.kept()})", param=param,
            code="previous_response_not_found" if param else "response_not_found"))
