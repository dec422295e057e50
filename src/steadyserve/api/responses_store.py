"""The Responses API's memory: stored responses, for `previous_response_id` and GET / DELETE /v1/responses/{id}.

In memory and bounded: at most --responses-store-size responses (default MAX_RESPONSES) and MAX_BYTES of them (their JSON), the oldest evicted
first. An evicted id is remembered (the last MAX_EVICTED of them) so that asking for it says it was evicted,
not that it never existed; either way the answer is a 404. Nothing survives a restart, and replicas do not
share it: a client that chains responses across replicas needs sticky routing (docs/deploy.md).

Each response belongs to the tenant that made it (--api-keys; "" on a server without keys). Another tenant
asking for it gets the very 404 of an id never stored (not a 403: no answer tells one tenant which ids another
holds), and the bounds are shared: the oldest response is evicted first, whoever made it.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

from ..limits import Refused

MAX_RESPONSES = 1024  # responses kept at most
MAX_BYTES = 64 * 1024 * 1024  # their JSON (response and conversation), at most
MAX_EVICTED = 8192  # evicted ids remembered, to say so


@dataclass(frozen=True)
class StoredResponse:
    """One stored response and the conversation it ends."""

    response: dict[str, Any]  # the response object as GET returns it
    conversation: list[dict[str, Any]]  # chat messages up to and including its output (without instructions)
    size: int  # bytes of JSON it accounts for
    owner: str = ""  # the tenant that made it (api/tenancy.py); "" on a server without keys


class ResponseStore:
    """Oldest-first eviction under both bounds; safe to use from the event loop and the tokenizer thread."""

    def __init__(self, max_responses: int = MAX_RESPONSES, max_bytes: int = MAX_BYTES) -> None:
        self.max_responses = max_responses
        self.max_bytes = max_bytes
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()  # id -> stored, oldest first
        self._evicted: OrderedDict[str, str] = OrderedDict()  # ids evicted -> their owner, oldest first
        self._bytes = 0
        self._lock = threading.Lock()

    def put(self, response: dict[str, Any], conversation: list[dict[str, Any]], owner: str = "") -> None:
        size = len(json.dumps(response)) + len(json.dumps(conversation))
        with self._lock:
            rid = response["id"]
            if rid in self._items:
                self._bytes -= self._items.pop(rid).size
            self._items[rid] = StoredResponse(response, conversation, size, owner)
            self._bytes += size
            while len(self._items) > self.max_responses or (self._bytes > self.max_bytes and len(self._items) > 1):
                old_id, old = self._items.popitem(last=False)
                self._bytes -= old.size
                self._evicted[old_id] = old.owner
                if len(self._evicted) > MAX_EVICTED:
                    self._evicted.popitem(last=False)

    def get(self, rid: str, param: str | None = None, owner: str = "") -> StoredResponse:
        """Tenant `owner`'s stored response, or Refused('not_found') (a 404) saying whether it was evicted; one
        of another tenant's is not found."""
        with self._lock:
            item = self._items.get(rid)
            evicted = self._evicted.get(rid) == owner
        if item is not None and item.owner != owner:
            item = None
        if item is None:
            if evicted:
                raise Refused("not_found", f"response {rid!r} was evicted from this server's store (it keeps the "
                              f"last {self.max_responses} responses, at most {self.max_bytes // 2**20} MiB)", param)
            raise Refused("not_found", f"response {rid!r} not found (never stored here: store was false, or "
                          "another replica or an earlier run of the server made it)", param)
        return item

    def delete(self, rid: str, owner: str = "") -> None:
        self.get(rid, None, owner)
        with self._lock:
            item = self._items.pop(rid, None)
            if item is not None:
                self._bytes -= item.size

    def __len__(self) -> int:
        return len(self._items)
