"""The Responses API's store: chains of turns, the least recently used forgotten first."""

from __future__ import annotations

from cobatch.server.response_store import ResponseStore


def _turn(i: int) -> list[dict]:
    return [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]


def test_a_chain_is_its_turns_in_order_and_breaks_where_one_is_forgotten():
    store = ResponseStore(capacity=3)
    store.put({"id": "r0"}, _turn(0), None)
    store.put({"id": "r1"}, _turn(1), "r0")
    store.put({"id": "r2"}, _turn(2), "r1")
    assert [m["content"] for m in store.conversation("r2")] == ["q0", "a0", "q1", "a1", "q2", "a2"]
    assert store.conversation("r1") == _turn(0) + _turn(1)

    store.put({"id": "x"}, _turn(9), None)          # over capacity: the least recently used (r2) goes
    assert store.get("r2") is None and store.get("r0") is not None
    assert store.conversation("r1") == _turn(0) + _turn(1)
    assert store.delete("r0") and not store.delete("r0")
    assert store.conversation("r1") is None          # its start is gone
    assert store.conversation("nope") is None


def test_what_is_stored_is_a_copy():
    store, turn = ResponseStore(), _turn(0)
    store.put({"id": "r"}, turn, None)
    turn[0]["content"] = "changed"
    assert store.conversation("r")[0]["content"] == "q0"
