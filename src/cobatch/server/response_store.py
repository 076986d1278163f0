"""The Responses API's stored responses: what `previous_response_id`, GET and DELETE /v1/responses/{id} read.

A response created with `store` (OpenAI's default) is kept once it has ended: the response object as answered,
and the conversation that led to it (its chain of earlier inputs and outputs, then its own input and output, as
chat messages). A request naming it as `previous_response_id` continues that conversation; its own `instructions`
replace the earlier ones, as OpenAI's do. Kept in this process's memory, the most recently used MAX_STORED: a
restart forgets them, and so does each replica of `serve -dp` the ones another replica answered.
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
    conversation: list[dict]    # chat messages: the earlier turns, this input and this output (no instructions)


class ResponseStore:
    def __init__(self, capacity: int = MAX_STORED):
        self.capacity = capacity
        self._items: OrderedDict[str, StoredResponse] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, response: dict, conversation: list[dict]) -> None:
        with self._lock:
            self._items[response["id"]] = StoredResponse(copy.deepcopy(response), copy.deepcopy(conversation))
            self._items.move_to_end(response["id"])
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def get(self, response_id: str) -> StoredResponse | None:
        with self._lock:
            item = self._items.get(response_id)
            if item is not None:
                self._items.move_to_end(response_id)
            return item

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._items.pop(response_id, None) is not None
