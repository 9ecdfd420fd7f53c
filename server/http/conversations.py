"""OpenAI's Conversations: a conversation is a list of Responses items that responses made with
`conversation` read before their input and add their input and output to. Kept in memory until
deleted or a restart, the last `server.responses_store_size` (least recently used out first),
as the responses are."""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from api_schemas.responses import ConversationObject, ResponseItem
from server.http.errors import APIError


@dataclass
class Conversation:
    info: ConversationObject
    items: list[ResponseItem] = field(default_factory=list)

    def item(self, item_id: str) -> ResponseItem:
        for item in self.items:
            if item.id == item_id:
                return item
        raise APIError(404, f"No item with id {item_id!r} in conversation {self.info.id!r}",
                       param="item_id", code="item_not_found", redact=False)


class ConversationStore:
    def __init__(self, max_entries: int):
        self.max_entries = max_entries
        self._entries: OrderedDict[str, Conversation] = OrderedDict()

    def create(self, metadata: dict | None, items: list[ResponseItem]) -> Conversation:
        if self.max_entries <= 0:
            raise APIError(400, "conversations are kept in the response store, which keeps"
                           " none here (server.responses_store_size: 0)", code="invalid_value",
                           redact=False)
        conversation = Conversation(ConversationObject(metadata=metadata or {}), items)
        self._entries[conversation.info.id] = conversation
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)
        return conversation

    def get(self, conversation_id: str, *, param: str | None = "conversation_id"
            ) -> Conversation:
        """404 in OpenAI's shape for an id never created, deleted, or evicted."""
        conversation = self._entries.get(conversation_id)
        if conversation is None:
            raise APIError(404, f"No conversation with id {conversation_id!r} (conversations"
                           f" are kept in memory, the last {self.max_entries}, until a"
                           " restart)", param=param, code="conversation_not_found",
                           redact=False)
        self._entries.move_to_end(conversation_id)
        return conversation

    def delete(self, conversation_id: str) -> None:
        self.get(conversation_id)
        del self._entries[conversation_id]
