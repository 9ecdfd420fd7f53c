"""The Responses API's store: finished responses by id, for `GET /v1/responses/{id}` and for
`previous_response_id`, bounded (least recently used first out) and in memory only."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Generic, TypeVar

from api_schemas.responses import ResponseItem, ResponseObject
from server.http.errors import APIError

T = TypeVar("T")


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: tuple[ResponseItem, ...]  # what `input_items` lists: the input history's items

    def context(self) -> list[ResponseItem]:
        """The items a response that follows this one starts from: its input and its output."""
        return [*self.items, *self.response.output]


class BoundedStore(Generic[T]):
    """Entries by id, in memory until a restart: the last `max_entries` used (least recently
    used out first); 0 keeps none."""

    kind = "entries"  # what the 404 says is kept

    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, T] = OrderedDict()

    def _put(self, key: str, entry: T) -> None:
        if self.max_entries <= 0:
            return
        self._entries[key] = entry
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def _get(self, key: str, missing: Callable[[], APIError]) -> T:
        """The entry, or `missing()` (a 404) for an id never stored, deleted, or evicted."""
        entry = self._entries.get(key)
        if entry is None:
            raise missing()
        self._entries.move_to_end(key)
        return entry

    def kept(self) -> str:
        return (f"{self.kind} are kept in memory, the last {self.max_entries}, until a"
                " restart")

    def delete(self, key: str) -> None:
        self.get(key)
        del self._entries[key]

    def get(self, key: str, *, param: str | None = None) -> T:
        raise NotImplementedError

    def __len__(self) -> int:
        return len(self._entries)


class ResponseStore(BoundedStore[StoredResponse]):
    kind = "responses"

    def put(self, response: ResponseObject, items: list[ResponseItem]) -> None:
        self._put(response.id, StoredResponse(response, tuple(items)))

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        what = "Previous response" if param else "Response"
        return self._get(response_id, lambda: APIError(
            404, f"{what} with id {response_id!r} not found ({self.kept()})", param=param,
            code="previous_response_not_found" if param else "response_not_found"))
