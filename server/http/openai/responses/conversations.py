"""OpenAI's Conversations: a conversation is a list of Responses items that responses made with
`conversation` read before their input and add their input and output to. Kept as the
responses are: the last `server.responses_store_size` (least recently used out first), in
memory until deleted or a restart, or with `server.state_dir` across restarts. Every change
goes through the store, which writes it through."""

from __future__ import annotations

from dataclasses import dataclass, field

from api_schemas.responses import ConversationObject, ResponseItem
from server.http.common.errors import APIError
from server.http.openai.responses.store import ITEMS, BoundedStore


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


class ConversationStore(BoundedStore[Conversation]):
    kind = "conversations"

    def create(self, metadata: dict | None, items: list[ResponseItem]) -> Conversation:
        if self.max_entries <= 0:
            raise APIError(400, "conversations are kept beside the responses, and this server"
                           " keeps none (server.responses_store_size: 0)", code="invalid_value",
                           redact=False)
        conversation = Conversation(ConversationObject(metadata=metadata or {}), items)
        self._put(conversation.info.id, conversation)
        return conversation

    def get(self, conversation_id: str, *, param: str | None = "conversation_id"
            ) -> Conversation:
        return self._get(conversation_id, lambda: APIError(
            404, f"No conversation with id {conversation_id!r} ({self.kept()})", param=param,
            code="conversation_not_found", redact=False))

    def extend(self, conversation: Conversation, items: list[ResponseItem]) -> None:
        conversation.items.extend(items)
        self._changed(conversation)

    def set_metadata(self, conversation: Conversation, metadata: dict[str, str]) -> None:
        conversation.info.metadata = metadata
        self._changed(conversation)

    def remove_item(self, conversation: Conversation, item_id: str) -> None:
        conversation.items.remove(conversation.item(item_id))
        self._changed(conversation)

    def _changed(self, conversation: Conversation) -> None:
        if conversation.info.id in self._entries:  # not deleted meanwhile
            self._save(conversation.info.id)

    def _encode(self, entry: Conversation) -> dict:
        return {"info": entry.info.model_dump(mode="json"),
                "items": ITEMS.dump_python(entry.items, mode="json")}

    def _decode(self, value: dict) -> Conversation:
        return Conversation(ConversationObject.model_validate(value["info"]),
                            ITEMS.validate_python(value["items"]))
