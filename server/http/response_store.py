"""The Responses API's store: finished responses by id, for `GET /v1/responses/{id}` and for
`previous_response_id`, bounded (least recently used first out) and in memory only."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from api_schemas.responses import ResponseItem, ResponseObject
from server.http.errors import APIError


@dataclass(frozen=True)
class StoredResponse:
    response: ResponseObject
    items: tuple[ResponseItem, ...]  # what `input_items` lists: the input history's items

    def context(self) -> list[ResponseItem]:
        """The items a response that follows this one starts from: its input and its output."""
        return [*self.items, *self.response.output]


class ResponseStore:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()

    def put(self, response: ResponseObject, items: list[ResponseItem]) -> None:
        if self.max_entries <= 0:
            return
        self._entries[response.id] = StoredResponse(response, tuple(items))
        self._entries.move_to_end(response.id)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def get(self, response_id: str, *, param: str | None = None) -> StoredResponse:
        """404 in OpenAI's shape for an id never stored, deleted, or evicted."""
        entry = self._entries.get(response_id)
        if entry is None:
            what = "Previous response" if param else "Response"
            raise APIError(404, f"{what} with id {response_id!r} not found (responses are kept"
                           f" in memory, the last {self.max_entries}, until a restart)",
                           param=param, code="previous_response_not_found" if param
                           else "response_not_found")
        self._entries.move_to_end(response_id)
        return entry

    def delete(self, response_id: str) -> None:
        self.get(response_id)
        del self._entries[response_id]

    def __len__(self) -> int:
        return len(self._entries)
