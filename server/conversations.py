"""OpenAI's Conversations API: a conversation is a list of items (messages,
function calls, their outputs, reasoning) under an id, which a Responses
request continues (``conversation``): its items are the context before the
request's input, and when the response ends its input items and output items
are added at the end (``extend``), so the next request sees the whole exchange.

Conversations are kept per API key in the response store (``ResponseStore``:
its limits, its LRU, its SQLite file with ``--response-store``), one entry each,
the conversation object as the entry's ``response`` (``object: "conversation"``)
and its items as the entry's ``input_items``, listed as the API lists them
(``responses.input_items``: each with an ``id``). Used from the event loop only.
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Callable

from server.errors import APIError
from server.protocol import ResponseInputItem
from server.response_store import ResponseStore, StoredResponse
from server.listing import items_page
from server.responses import check_item_ids, held_item_ids, input_items, item_messages

log = logging.getLogger("jaxserve.server")

KIND = "conversation"   # the entries' ``object`` in the response store


class Conversations:
    """The Conversations API over ``store``; every method takes the caller's ``owner`` (API
    key): another key's conversation is not found (404 ``conversation_not_found``)."""

    def __init__(self, store: ResponseStore) -> None:
        self.store = store
        self._busy: set[str] = set()   # conversations a response is running on

    def lock(self, conversation_id: str, owner: str) -> Callable[[], None]:
        """Hold ``owner``'s conversation for one response (a 404 naming ``conversation`` when
        it has none such); the function that lets it go (once; later calls do nothing). A
        conversation held already is a 400 ``conversation_locked``, as OpenAI answers: two
        responses at once would each read it without the other's turn."""
        self.get(conversation_id, owner, "conversation")
        self._refuse_if_busy(conversation_id, "conversation", "Another response is running on this conversation")
        self._busy.add(conversation_id)
        held = [True]

        def release() -> None:
            if held:   # (once: a second call must not free a later response's hold)
                held.clear()
                self._busy.discard(conversation_id)
        return release

    def _refuse_if_busy(self, conversation_id: str, param: str, what: str) -> None:
        """A 400 ``conversation_locked`` naming ``param`` while a response runs on the conversation."""
        if conversation_id in self._busy:
            raise APIError(400, f"{what}; retry when it has ended", param=param, code="conversation_locked")

    def create(self, owner: str, items: list[ResponseInputItem], metadata: dict | None) -> dict:
        """A new conversation holding ``items``; its object."""
        check_item_ids(items, set(), "items")
        conversation = {"id": f"conv_{uuid.uuid4().hex}", "object": KIND, "created_at": int(time.time()),
                        "metadata": metadata or {}}
        self._put(owner, conversation, input_items(items))
        return conversation

    def get(self, conversation_id: str, owner: str, param: str = "conversation_id") -> StoredResponse:
        entry = self.store.get(conversation_id, owner, KIND)
        if entry is None:
            raise APIError(404, f"conversation {conversation_id!r} not found", param=param,
                           code="conversation_not_found")
        return entry

    def update(self, conversation_id: str, owner: str, metadata: dict) -> dict:
        """Replace the conversation's ``metadata``; its object."""
        entry = self.get(conversation_id, owner)
        conversation = {**entry.response, "metadata": metadata}
        self._put(owner, conversation, entry.input_items)
        return conversation

    def delete(self, conversation_id: str, owner: str) -> dict:
        """Delete the conversation (responses that continued it are kept)."""
        if not self.store.delete(conversation_id, owner, KIND):
            self.get(conversation_id, owner)   # (the 404)
        return {"id": conversation_id, "object": "conversation.deleted", "deleted": True}

    def add_items(self, conversation_id: str, owner: str, items: list[ResponseInputItem]) -> dict:
        """Add ``items`` at the conversation's end; the list of the items added, with their ids.
        Not while a response runs on it (a 400 ``conversation_locked``): the response's own
        input and output are added when it ends, and the items would precede a turn that
        never saw them."""
        entry = self.get(conversation_id, owner)
        self._refuse_if_busy(conversation_id, "conversation_id", "A response is running on this conversation")
        check_item_ids(items, held_item_ids([entry]), "items")
        added = input_items(items)
        self._put(owner, entry.response, entry.input_items + added)
        return {"object": "list", "data": added, "first_id": added[0]["id"], "last_id": added[-1]["id"],
                "has_more": False}

    def items(self, conversation_id: str, owner: str, limit: int, order: str, after: str | None) -> dict:
        """A page of the conversation's items (``listing.items_page``)."""
        return items_page(self.get(conversation_id, owner).input_items, limit, order, after,
                          f"conversation {conversation_id!r}")

    def item(self, conversation_id: str, owner: str, item_id: str) -> dict:
        return _find(self.get(conversation_id, owner), item_id)

    def delete_item(self, conversation_id: str, owner: str, item_id: str) -> dict:
        """Remove one item; the conversation's object. Not while a response runs on it (a 400
        ``conversation_locked``: that response was built on the item)."""
        entry = self.get(conversation_id, owner)
        _find(entry, item_id)   # (the 404)
        self._refuse_if_busy(conversation_id, "conversation_id", "A response is running on this conversation")
        self._put(owner, entry.response, [i for i in entry.input_items if i["id"] != item_id])
        return entry.response

    def messages(self, conversation_id: str, owner: str, adding: list[ResponseInputItem] | str = "") -> list[dict]:
        """The chat messages of the conversation's items (the context a Responses request
        that continues it starts from); a 404 naming ``conversation`` when it is not found,
        a 400 naming ``input`` when an item of ``adding`` (the request's input) repeats an
        id (``check_item_ids``)."""
        entry = self.get(conversation_id, owner, "conversation")
        check_item_ids(adding, held_item_ids([entry]), "input")
        return item_messages(entry.input_items)

    def extend(self, conversation_id: str, owner: str, items: list[dict]) -> None:
        """Add a response's input and output ``items`` (as the API lists them) at the end of
        the conversation it continued; one deleted since is not brought back (logged)."""
        entry = self.store.get(conversation_id, owner, KIND)
        if entry is None:
            log.warning("conversation %s: gone before a response that continued it ended; its items are not kept",
                        conversation_id)
        elif not self._kept(owner, entry.response, entry.input_items + items):
            log.warning("conversation %s: a response's items would exceed the store's %d bytes; not added",
                        conversation_id, self.store.max_bytes)

    def _put(self, owner: str, conversation: dict, items: list[dict]) -> None:
        if not self._kept(owner, conversation, items):
            raise APIError(400, f"conversation {conversation['id']!r}: its items would exceed the store's "
                           f"{self.store.max_bytes} bytes", param="items")

    def _kept(self, owner: str, conversation: dict, items: list[dict]) -> bool:
        """Store the conversation with ``items``; whether it fit (else it stays as it was)."""
        return self.store.put(conversation["id"], StoredResponse(owner, None, [], conversation, items))


def _find(entry: StoredResponse, item_id: str) -> dict:
    """The item ``item_id`` of a conversation; a 404 ``item_not_found`` when it has none."""
    found = next((i for i in entry.input_items if i["id"] == item_id), None)
    if found is None:
        raise APIError(404, f"item {item_id!r} not found in conversation {entry.response['id']!r}", param="item_id",
                       code="item_not_found")
    return found
