"""The scheduling policies (engine/scheduler.py): fcfs, and priority as vLLM's --scheduling-policy priority takes it,
in the scheduler alone, in the engine on SmolLM2 (CPU), in the server's queue and through the openai client."""

from __future__ import annotations

import openai
import pytest

from cobatch.engine.kv_cache import BlockManager
from cobatch.engine.sampler import SamplingParams
from cobatch.engine.scheduler import Scheduler
from cobatch.engine.sequence import Sequence
from cobatch.errors import UserError
from cobatch.server.engine_thread import EngineWorker, RequestHandle
from model_fixtures import load_llm
from test_server_support import live_server


def _seq(name: str, priority: int, first_token: int, n_tokens: int = 6) -> Sequence:
    ids = list(range(first_token, first_token + n_tokens))        # no two prompts share a block
    return Sequence(name, n_tokens, SamplingParams(priority=priority), 0, ids)


def _planned(scheduler: Scheduler) -> list[str]:
    return [seq.request_id for seq, _ in scheduler.plan().items]


def test_priority_orders_admission_and_the_step_fcfs_arrival():
    """One slot: fcfs admits in arrival order; priority the lowest value first, ties in arrival order."""
    for policy, want in (("fcfs", ["a", "b", "c", "d"]), ("priority", ["d", "b", "a", "c"])):
        scheduler = Scheduler(BlockManager(64, 4), max_num_seqs=1, max_step_tokens=64, prefill_chunk=64,
                              policy=policy)
        for i, (name, priority) in enumerate((("a", 5), ("b", 0), ("c", 5), ("d", -3))):
            scheduler.add(_seq(name, priority, 100 * i))
        order = []
        while scheduler.waiting:
            (seq, _), = scheduler.plan().items
            order.append(seq.request_id)
            scheduler.finished(seq)
        assert order == want, policy


def test_out_of_kv_the_least_urgent_gives_its_blocks_back():
    """Four blocks of 4 tokens hold two of three 6-token prompts. fcfs pushes back the newest (c); priority the
    least urgent (b, though it arrived before c), and it waits ahead of later arrivals as urgent as it."""
    for policy, want, pushed_back in (("fcfs", ["a", "b"], "c"), ("priority", ["a", "c"], "b")):
        scheduler = Scheduler(BlockManager(4, 4), max_num_seqs=3, max_step_tokens=64, prefill_chunk=64,
                              policy=policy)
        for i, (name, priority) in enumerate((("a", 0), ("b", 9), ("c", 0))):
            scheduler.add(_seq(name, priority, 100 * i))
        assert sorted(_planned(scheduler)) == want, policy
        assert [s.request_id for s in scheduler.waiting] == [pushed_back] and scheduler.stats.preemptions == 1
    scheduler.add(_seq("late", 9, 900))
    assert [s.request_id for s in scheduler.waiting] == ["b", "late"]


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="scheduling policy"):
        Scheduler(BlockManager(4, 4), 1, 64, 64, policy="lifo")


@pytest.fixture(scope="module")
def by_priority():
    """SmolLM2 with one sequence at a time, scheduled by priority."""
    return load_llm("smollm2", max_num_seqs=1, scheduling_policy="priority")


def test_engine_runs_the_most_urgent_request_first(by_priority):
    engine = by_priority.engine
    prompt = by_priority.encode_prompt("The capital of France is")
    ids = {engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=2, priority=p)): name
           for name, p in (("late", 3), ("urgent", -1), ("later", 3))}
    finished = []
    while engine.has_work():
        finished += [ids[o.request_id] for o in engine.step() if o.finished]
    assert finished == ["urgent", "late", "later"]


def test_priority_is_refused_by_an_fcfs_engine():
    llm = load_llm("smollm2")
    with pytest.raises(UserError, match="scheduling-policy priority"):
        llm.engine.add_request(llm.encode_prompt("Hi"), SamplingParams(priority=2))


def test_server_queue_gives_the_free_slot_to_the_most_urgent(by_priority):
    """The server's queue (EngineWorker, driven by hand here: no thread) orders waiting requests by priority, then
    arrival; its one slot goes to the most urgent."""
    worker = EngineWorker(by_priority.engine, max_queue=8)
    prompt = by_priority.encode_prompt("Hello")
    for name, p in (("a", 2), ("b", 0), ("c", 2), ("d", 1)):
        worker._handle(("add", RequestHandle(name, prompt, SamplingParams(max_tokens=1, priority=p), None)))
    assert [h.id for h in worker.queued()] == ["b", "d", "a", "c"]
    worker._admit()
    assert [seq.request_id for seq in by_priority.engine.scheduler.waiting] == ["b"]
    assert [h.id for h in worker.queued()] == ["d", "a", "c"]
    by_priority.engine.abort("b")
    by_priority.engine.step()


def test_openai_priority_field_needs_the_priority_policy():
    """vLLM's `priority` field: accepted by a server scheduling by priority, a 400 naming it on an fcfs one."""
    for policy in ("fcfs", "priority"):
        with live_server(load_llm("smollm2", scheduling_policy=policy)) as server:
            client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
            ask = dict(model="any", messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                       extra_body={"priority": 4})
            if policy == "priority":
                assert client.chat.completions.create(**ask).choices[0].finish_reason == "length"
                continue
            with pytest.raises(openai.BadRequestError) as err:
                client.chat.completions.create(**ask)
            assert err.value.status_code == 400 and "priority" in str(err.value)
            assert client.completions.create(model="any", prompt="Hi", max_tokens=1, extra_body={"priority": 0})
