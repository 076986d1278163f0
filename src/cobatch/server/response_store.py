"""The Responses API's stored responses: what `previous_response_id`, GET and DELETE /v1/responses/{id} read.

A response created with `store` (OpenAI's default) is kept once it has ended: the response object as answered,
its own turn (its input and output as chat messages) and the response it continued. A request naming it as
`previous_response_id` continues the whole chain's conversation; its own `instructions` replace the earlier ones,
as OpenAI's do. Each response keeps only its own turn, so a long chain costs its length, not its square. Kept in
this process's memory, the most recently used MAX_STORED (continuing a chain uses every response in it): a restart
forgets them, and so does each replica of `serve -dp` the ones another replica answered.
"""

from __future__ import annotations

import copy
import threading
from collections import OrderedDict
from dataclasses import dataclass

MAX_STORED = 4096


@dataclass(slots=True)
class StoredResponse:
    response: dict              # the response object as it was answered
    turn: list[dict]            # its input and output as chat messages (no instructions)
    previous: str | None        # the response it continued


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, turn: list[dict], previous: str | None) -> None:
        with self._lock:
            self._items[response["id"]] = StoredResponse(copy.deepcopy(response), copy.deepcopy(turn), previous)
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def conversation(self, response_id: str) -> list[dict] | None:
        """The chat messages of the chain that ends with this response, oldest first; None if it, or a response
        before it, is not stored."""
        turns = []
        while response_id is not None:
            item = self.get(response_id)
            if item is None:
                return None
            turns.append(item.turn)
            response_id = item.previous
        return [message for turn in reversed(turns) for message in turn]

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None
