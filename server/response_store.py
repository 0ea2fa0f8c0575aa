"""Stored Responses API responses (``store: true``) and Conversations API
conversations (``server.conversations``), in one bounded LRU per API key, kept in
memory and, with a path, in the server's state file too (``server.state_file``), so
conversations (``previous_response_id``, ``conversation``) outlive a restart. An
entry's ``response`` is the object the API returns for it; its ``object`` field
(``"response"``, ``"conversation"``) is the entry's kind, and a lookup of one kind
never finds the other.

The file is written through and read back whole when the store is opened, oldest
use first, within the same limits. A background response is stored when it is
created (``queued``) and again when it ends; one still ``queued`` or
``in_progress`` in a file being opened was running when the server stopped without
ending it (a crash: a clean stop cancels live runs), and reads back ``failed`` with
a ``server_error``, so its client's poll gets an answer, not a 404.
"""

from __future__ import annotations

import contextlib
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path

from server.errors import APIError
from server.state_file import StateFile

log = logging.getLogger("jaxserve.server")

UNFINISHED = ("queued", "in_progress")   # statuses of a background response that has not ended


@dataclass
class StoredResponse:
    owner: str
    parent: str | None           # previous_response_id
    messages: list[dict]         # what it added to the conversation: its input, then its answer (chat messages)
    response: dict               # the response object, as returned
    input_items: list[dict] = field(default_factory=list)   # its ``input`` as items with ids (``/input_items``)
    size: int = 0                # bytes it is charged (its messages, response and input items as JSON)


class ResponseStore:
    """Stored responses, at most ``capacity`` of them and ``max_bytes`` of their JSON.

    Each keeps only what it added to its conversation; ``chain`` rebuilds the
    whole by walking ``previous_response_id`` links (refreshing each link in its
    owner's LRU, so a live conversation's turns stay together). A response is visible
    only to the owner (API key) that stored it. Over a limit, the owner holding the
    most (bytes, or responses for the count) gives up its least recently used
    response: one busy key cannot push out another key's conversations while it holds
    more than they do. ``path``: the state file that keeps them across restarts
    (``server.state_file.StateFile``: created if missing; one that is not a state
    file is a ``ValueError``). Used from the event loop only."""

    def __init__(self, capacity: int = 4096, max_bytes: int = 256 * 2**20, path: str | Path | None = None) -> None:
        self.capacity, self.max_bytes = capacity, max_bytes
        self.num_bytes = 0
        self._entries: dict[str, StoredResponse] = {}
        self._by_owner: dict[str, OrderedDict[str, None]] = {}   # owner -> its response ids, least recent first
        self._owner_bytes: dict[str, int] = {}
        self.file: StateFile | None = None   # the state file (``path``), shared with the Files and Batch APIs
        self._uses = 0                  # the last use's number (a file's LRU order)
        if path is not None:
            self.file = StateFile(path)
            try:
                self._load()
            except BaseException:
                self.close()
                raise

    # ------------------------------------------------------------------ file
    def _load(self) -> None:
        """Read the file's responses back, within the limits; a ``ValueError`` naming the
        file when an entry is unreadable."""
        rows = self.file.rows("SELECT id, owner, used, entry FROM responses ORDER BY used")
        held, ended = {}, {}
        try:
            for response_id, owner, used, text in rows:   # (oldest use first: the LRU order comes back as it was)
                data = json.loads(text)
                if data["response"].get("status") in UNFINISHED:
                    data["response"] = stopped_by_restart(data["response"])
                    ended[response_id] = text = json.dumps(data)
                held[response_id] = (StoredResponse(owner, data["parent"], data["messages"], data["response"],
                                                    data["input_items"]), len(text))
                self._uses = max(self._uses, used)
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"response store {self.file.path}: unreadable ({type(e).__name__}: {e})") from None
        with self._transaction():
            file, self.file = self.file, None   # (the drops below the limits go to the file at the end, at once)
            for response_id, (entry, size) in held.items():
                if size <= self.max_bytes:
                    self._keep(response_id, entry, size)
            self.file = file
            self._write_many("DELETE FROM responses WHERE id = ?", [(i,) for i in set(held) - set(self._entries)])
            self._write_many("UPDATE responses SET entry = ? WHERE id = ?",
                             [(text, i) for i, text in ended.items() if i in self._entries])
        if ended:
            log.warning("response store: %d background response(s) were running when the server stopped; "
                        "they read back as failed", len(ended))

    def _transaction(self):
        """One file transaction for the writes inside (``StateFile.transaction``)."""
        return self.file.transaction() if self.file is not None else contextlib.nullcontext()

    def _write(self, sql: str, *params) -> None:
        self._write_many(sql, [params])

    def _write_many(self, sql: str, rows: list[tuple]) -> None:
        if self.file is not None:
            self.file.write_many(sql, rows)

    def _use(self) -> int:
        self._uses += 1
        return self._uses

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
            self.file = None

    # ------------------------------------------------------------- entries
    def put(self, response_id: str, entry: StoredResponse) -> bool:
        """Store ``entry``; whether it is kept. One that is not (larger than ``max_bytes``
        alone, or its owner holds the most and it would be the one given up) leaves an
        entry it replaces as it was (the owner's older entries may have been given up)."""
        text = _entry_text(entry)
        if len(text) > self.max_bytes:
            return False
        with self._transaction():
            previous = self._entries.get(response_id)
            self._drop(response_id)
            if not self._keep(response_id, entry, len(text)):
                if previous is not None:   # (it fit before, with more held than now: it fits again)
                    self._keep(response_id, previous, previous.size)
                    self._insert(response_id, previous, _entry_text(previous))
                return False
            self._insert(response_id, entry, text)
        return True

    def _insert(self, response_id: str, entry: StoredResponse, text: str) -> None:
        self._write("INSERT OR REPLACE INTO responses (id, owner, used, entry) VALUES (?, ?, ?, ?)",
                    response_id, entry.owner, self._use(), text)

    def _keep(self, response_id: str, entry: StoredResponse, size: int) -> bool:
        """Hold ``entry`` in memory (``size``: its JSON's length), then drop responses
        while over a limit; whether it is still held."""
        entry.size = size
        self._entries[response_id] = entry
        self._by_owner.setdefault(entry.owner, OrderedDict())[response_id] = None
        self._owner_bytes[entry.owner] = self._owner_bytes.get(entry.owner, 0) + entry.size
        self.num_bytes += entry.size
        while len(self._entries) > self.capacity:
            self._drop(next(iter(self._by_owner[max(self._by_owner, key=lambda o: len(self._by_owner[o]))])))
        while self.num_bytes > self.max_bytes:
            self._drop(next(iter(self._by_owner[max(self._owner_bytes, key=self._owner_bytes.get)])))
        return response_id in self._entries

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is None:
            return
        ids = self._by_owner[entry.owner]
        del ids[response_id]
        self.num_bytes -= entry.size
        self._owner_bytes[entry.owner] -= entry.size
        if not ids:
            del self._by_owner[entry.owner], self._owner_bytes[entry.owner]
        self._write("DELETE FROM responses WHERE id = ?", response_id)

    def get(self, response_id: str, owner: str, kind: str = "response") -> StoredResponse | None:
        """``owner``'s entry ``response_id`` of ``kind`` (its object's ``object``), else None."""
        entry = self._entries.get(response_id)
        if entry is None or entry.owner != owner or entry.response.get("object", "response") != kind:
            return None
        self._by_owner[owner].move_to_end(response_id)
        self._write("UPDATE responses SET used = ? WHERE id = ?", self._use(), response_id)
        return entry

    def delete(self, response_id: str, owner: str, kind: str = "response") -> bool:
        with self._transaction():
            if self.get(response_id, owner, kind) is None:
                return False
            self._drop(response_id)
            return True

    def chain(self, response_id: str, owner: str) -> list[StoredResponse]:
        """The stored turns of the conversation up to and including response ``response_id``,
        oldest first; a 404 naming ``previous_response_id`` when it (or a turn before it) is
        not stored."""
        chain, at = [], response_id
        with self._transaction():   # (one commit for the walk's refreshes)
            while at is not None:
                entry = self.get(at, owner)
                if entry is None:
                    missing = "" if at == response_id else f" (its earlier turn {at!r} is no longer stored)"
                    raise APIError(404, f"previous response {response_id!r} not found{missing}",
                                   param="previous_response_id", code="previous_response_not_found")
                chain.append(entry)
                at = entry.parent
                if len(chain) > self.capacity:   # (a loop cannot be stored, but never walk forever)
                    break
        return chain[::-1]


def _entry_text(entry: StoredResponse) -> str:
    """An entry as its file row holds it. ASCII JSON: text the API takes may hold lone
    surrogates (in metadata keys, schemas), which UTF-8 (and so SQLite) cannot hold;
    escaped, they read back the same."""
    return json.dumps({"parent": entry.parent, "messages": entry.messages, "response": entry.response,
                       "input_items": entry.input_items})


def stopped_by_restart(response: dict) -> dict:
    """A background ``response`` that was running when the server stopped, as it reads back:
    ``failed``, its ``error`` a ``server_error`` that says so (its output is lost)."""
    return {**response, "status": "failed", "error": {
        "code": "server_error", "message": "the server stopped before this background response ended; "
                                           "its output is lost: create it again"}}
