"""The HTTP server on the CPU path with SmolLM2, through the real openai and anthropic clients."""

from __future__ import annotations

import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor

import anthropic
import httpx
import openai
import pytest

from model_fixtures import load_llm
from test_server_support import RawStream, all_slots_idle, live_server, metric, slots, wait_for

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
GREEDY = {"temperature": 0}


@pytest.fixture(scope="module")
def server():
    with live_server(load_llm("smollm2")) as srv:
        yield srv


@pytest.fixture(scope="module")
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)


def _stream_text(stream) -> tuple[str, str | None, object]:
    text, finish, usage = [], None, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            delta = getattr(choice, "delta", None)
            text.append((delta.content or "") if delta is not None else choice.text)
            finish = choice.finish_reason or finish
    return "".join(text), finish, usage


# --- the basics, through both SDKs ---------------------------------------------------------------------

def test_models_and_health(server, oai):
    models = oai.models.list().data
    assert [m.id for m in models] == [server.context.model_name]
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and health["slots_total"] == 8
    head = httpx.head(server.url + "/health")
    assert head.status_code == 200 and head.content == b""
    assert httpx.get(server.url + "/v1/health").json()["status"] == "ok"      # llama.cpp's other path


def test_sagemaker_ping_and_invocations(server, oai):
    """SageMaker's contract: /ping is /health; /invocations answers a chat, completions or embeddings request as
    its route does, told apart by the body (streamed too), and refuses one it cannot tell in OpenAI's shape."""
    assert httpx.get(server.url + "/ping").json() == httpx.get(server.url + "/health").json()
    invoke = server.url + "/invocations"
    chat = httpx.post(invoke, json={"messages": QUESTION, "max_tokens": 12, **GREEDY}, timeout=60).json()
    direct = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=12, **GREEDY)
    assert chat["object"] == "chat.completion" and chat["choices"][0]["message"]["content"] == \
        direct.choices[0].message.content
    text = httpx.post(invoke, json={"prompt": "The capital of France is", "max_tokens": 4, **GREEDY}, timeout=60)
    assert text.json()["object"] == "text_completion"
    vector = httpx.post(invoke, json={"input": "hello"}, timeout=60).json()
    assert vector["object"] == "list" and len(vector["data"][0]["embedding"]) > 0
    with httpx.stream("POST", invoke, json={"messages": QUESTION, "max_tokens": 4, "stream": True}, timeout=60) as r:
        frames = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert r.headers["content-type"].startswith("text/event-stream") and frames[-1] == "data: [DONE]"
    for body, message in (({"tokens": [1]}, "an invocation is"), (b"{nope", "malformed JSON")):
        kwargs = {"content": body} if isinstance(body, bytes) else {"json": body}
        bad = httpx.post(invoke, timeout=60, **kwargs)
        assert bad.status_code == 400 and message in bad.json()["error"]["message"]
    wrong = httpx.post(invoke, json={"messages": "hi"}, timeout=60)        # the chat route's own validation
    assert wrong.status_code == 400 and wrong.json()["error"]["param"] == "messages"


def test_chat_completion_plain_and_streamed(oai):
    plain = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=20, **GREEDY)
    choice = plain.choices[0]
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    usage = plain.usage
    assert usage.prompt_tokens > 0 and usage.completion_tokens > 0
    assert usage.total_tokens == usage.prompt_tokens + usage.completion_tokens

    stream = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=20, stream=True,
                                         stream_options={"include_usage": True}, **GREEDY)
    text, finish, usage2 = _stream_text(stream)
    assert text == choice.message.content and finish == "stop"
    assert usage2.prompt_tokens == usage.prompt_tokens and usage2.completion_tokens == usage.completion_tokens
    # Same prompt again: its full blocks come from the prefix cache.
    assert usage2.prompt_tokens_details.cached_tokens >= 16


def test_chat_length_finish_and_logprobs(oai):
    out = oai.chat.completions.create(model="any", messages=QUESTION, max_completion_tokens=3, logprobs=True,
                                      top_logprobs=2, **GREEDY)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and out.usage.completion_tokens == 3
    entries = choice.logprobs.content
    assert len(entries) == 3 and "".join(e.token for e in entries) == choice.message.content
    for e in entries:
        assert e.logprob <= 0 and len(e.top_logprobs) == 2
        assert e.top_logprobs[0].token == e.token      # greedy picks the most likely token


def test_completion_plain_and_streamed(oai):
    prompt = "The capital of France is"
    plain = oai.completions.create(model="any", prompt=prompt, max_tokens=12, logprobs=1, **GREEDY)
    choice = plain.choices[0]
    assert choice.text.startswith(" Paris") and choice.finish_reason == "length"
    assert "".join(choice.logprobs.tokens) == choice.text
    assert len(choice.logprobs.token_logprobs) == 12 == plain.usage.completion_tokens
    text, finish, usage = _stream_text(oai.completions.create(
        model="any", prompt=prompt, max_tokens=12, stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert (text, finish) == (choice.text, "length") and usage.completion_tokens == 12
    # Token ids are a prompt too; echo gives the prompt back in front.
    ids = load_llm("smollm2").encode_prompt(prompt)
    echoed = oai.completions.create(model="any", prompt=ids, max_tokens=12, echo=True, **GREEDY)
    assert echoed.choices[0].text == prompt + choice.text


def test_logit_bias_forces_and_bans_tokens(oai):
    """OpenAI logit_bias: +100 makes a token the greedy choice, -100 bans it; keys are token-id strings."""
    prompt = "The capital of France is"
    tokenizer = load_llm("smollm2").tokenizer
    london = tokenizer.encode(" London", add_special=False)[0]
    forced = oai.completions.create(model="any", prompt=prompt, max_tokens=1, logit_bias={str(london): 100},
                                    **GREEDY)
    assert forced.choices[0].text == tokenizer.decode([london])
    plain = oai.completions.create(model="any", prompt=prompt, max_tokens=1, **GREEDY).choices[0].text
    paris = tokenizer.encode(plain, add_special=False)[0]
    banned = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                         max_completion_tokens=4, **GREEDY)
    first = tokenizer.encode(banned.choices[0].message.content, add_special=False)[0]
    again = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": prompt}],
                                        max_completion_tokens=4, logit_bias={str(first): -100}, **GREEDY)
    assert tokenizer.encode(again.choices[0].message.content, add_special=False)[0] != first
    assert paris != london


def test_vllm_sampling_extras(oai):
    """vLLM's extra sampling fields, through the openai client's extra_body: allowed_token_ids,
    bad_words, include_stop_str_in_output, skip_special_tokens and truncate_prompt_tokens."""
    tokenizer = load_llm("smollm2").tokenizer
    prompt = "The capital of France is"
    plain = oai.completions.create(model="any", prompt=prompt, max_tokens=8, **GREEDY).choices[0].text
    first = tokenizer.encode(plain, add_special=False)[0]
    london, berlin = (tokenizer.encode(w, add_special=False)[0] for w in (" London", " Berlin"))
    assert first not in (london, berlin)

    # allowed_token_ids: every sampled token is one of them, greedy or not
    for extra in ({}, {"temperature": 1.0, "seed": 3}):
        out = oai.completions.create(model="any", prompt=prompt, max_tokens=4, logprobs=0,
                                     extra_body={"allowed_token_ids": [london, berlin], **GREEDY, **extra})
        ids = [tokenizer.encode(t, add_special=False) for t in out.choices[0].logprobs.tokens]
        assert all(t == [london] or t == [berlin] for t in ids), ids

    # bad_words: the greedy continuation's first word is banned, whether at the start or after a space
    word = plain.split()[0]
    out = oai.completions.create(model="any", prompt=prompt, max_tokens=8, extra_body={"bad_words": [word], **GREEDY})
    assert word not in out.choices[0].text.split() and out.choices[0].text != plain

    # include_stop_str_in_output: the text runs to the end of the stop string instead of its start
    stop = plain.split()[1] if len(plain.split()) > 1 else plain.split()[0]
    cut = oai.completions.create(model="any", prompt=prompt, max_tokens=8, stop=[stop], **GREEDY).choices[0]
    kept = oai.completions.create(model="any", prompt=prompt, max_tokens=8, stop=[stop],
                                  extra_body={"include_stop_str_in_output": True, **GREEDY}).choices[0]
    assert cut.finish_reason == kept.finish_reason == "stop"
    assert kept.text == cut.text + stop and plain.startswith(kept.text)

    # stop_token_ids: the stopping token's text is left out, unless include_stop_str_in_output
    stop_id = tokenizer.encode(plain, add_special=False)[1]
    without = oai.completions.create(model="any", prompt=prompt, max_tokens=8,
                                     extra_body={"stop_token_ids": [stop_id], **GREEDY}).choices[0]
    with_it = oai.completions.create(model="any", prompt=prompt, max_tokens=8, extra_body={
        "stop_token_ids": [stop_id], "include_stop_str_in_output": True, **GREEDY}).choices[0]
    assert without.finish_reason == "stop" and with_it.text == without.text + tokenizer.decode([stop_id])

    # skip_special_tokens: false lets a special token's text through (here the chat template's own, forced)
    im_end = tokenizer.encode("<|im_end|>", add_special=False)
    assert len(im_end) == 1
    special = {"logit_bias": {str(im_end[0]): 100}, "ignore_eos": True, **GREEDY}
    hidden = oai.completions.create(model="any", prompt=prompt, max_tokens=2, extra_body=special).choices[0]
    shown = oai.completions.create(model="any", prompt=prompt, max_tokens=2,
                                   extra_body={**special, "skip_special_tokens": False}).choices[0]
    assert hidden.text == "" and shown.text == "<|im_end|><|im_end|>"

    # truncate_prompt_tokens: only the prompt's last k tokens are read
    tail = tokenizer.encode(prompt, add_special=False)
    ids = tokenizer.encode("Some unrelated words first.", add_special=False) + tail
    truncated = oai.completions.create(model="any", prompt=ids, max_tokens=8,
                                       extra_body={"truncate_prompt_tokens": len(tail), **GREEDY})
    assert truncated.usage.prompt_tokens == len(tail)
    assert truncated.choices[0].text == oai.completions.create(model="any", prompt=tail, max_tokens=8,
                                                               **GREEDY).choices[0].text


@pytest.mark.parametrize("kind", ["chat", "completions"])
def test_continuous_usage_stats_count_each_chunk(oai, kind):
    """vLLM's stream_options.continuous_usage_stats: every chunk carries the usage so far (completion tokens
    never falling, the prompt's fixed), the last one the final usage; without it, choice chunks carry null."""
    ask = dict(model="any", max_tokens=6, stream=True, **GREEDY)
    if kind == "chat":
        ask["messages"], create = QUESTION, oai.chat.completions.create
    else:
        ask["prompt"], create = "The capital of France is", oai.completions.create
    chunks = list(create(**ask, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    counted = [c.usage for c in chunks if c.choices]
    assert counted and all(u is not None for u in counted)
    steps = [u.completion_tokens for u in counted]
    assert steps == sorted(steps) and steps[-1] == chunks[-1].usage.completion_tokens == 6
    assert {u.prompt_tokens for u in counted} == {chunks[-1].usage.prompt_tokens}
    plain = list(create(**ask, stream_options={"include_usage": True}))
    assert all(c.usage is None for c in plain if c.choices) and plain[-1].usage.completion_tokens == 6


def test_cache_salt_is_taken_and_an_empty_one_refused(oai):
    """vLLM's cache_salt (prefix-cache isolation per tenant): a salted request is served; an empty salt is a 400."""
    ask = dict(model="any", messages=QUESTION, max_tokens=2, **GREEDY)
    assert oai.chat.completions.create(**ask, extra_body={"cache_salt": "tenant-1"}).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**ask, extra_body={"cache_salt": ""})
    assert "cache_salt" in str(err.value)


def test_anthropic_messages_plain_streamed_and_count_tokens(claude):
    kwargs = dict(model="any", max_tokens=20, system="You are a concise assistant.", messages=QUESTION,
                  extra_body=GREEDY)
    counted = claude.messages.count_tokens(model="any", system=kwargs["system"], messages=QUESTION).input_tokens
    plain = claude.messages.create(**kwargs)
    assert plain.stop_reason == "end_turn" and plain.content[0].type == "text"
    assert "Paris" in plain.content[0].text
    u = plain.usage
    assert u.input_tokens + u.cache_read_input_tokens == counted    # Anthropic: input excludes cache reads
    with claude.messages.stream(**kwargs) as stream:
        pieces = list(stream.text_stream)
        final = stream.get_final_message()
    assert "".join(pieces) == plain.content[0].text == final.content[0].text
    assert final.stop_reason == "end_turn" and final.usage.output_tokens == u.output_tokens
    assert final.usage.input_tokens + final.usage.cache_read_input_tokens == counted
    assert final.usage.cache_read_input_tokens > 0     # the second time, the prefix is cached


def test_anthropic_text_document_reads_as_its_title_and_text(claude):
    document = {"type": "document", "title": "Notes", "source": {"type": "text", "media_type": "text/plain",
                                                                 "data": "The capital of France is Paris."}}
    ask = {"type": "text", "text": "What does the note say?"}
    as_document = claude.messages.count_tokens(model="any", messages=[{"role": "user", "content": [document, ask]}])
    as_text = claude.messages.count_tokens(model="any", messages=[{"role": "user", "content": [
        {"type": "text", "text": "Notes\n\nThe capital of France is Paris."}, ask]}])
    assert as_document.input_tokens == as_text.input_tokens
    blocks = {**document, "source": {"type": "content", "content": [{"type": "text", "text": "The capital of "
                                                                                        "France is Paris."}]}}
    assert claude.messages.count_tokens(model="any", messages=[
        {"role": "user", "content": [blocks, ask]}]).input_tokens == as_text.input_tokens


def test_anthropic_stream_event_sequence(server):
    body = {"model": "any", "max_tokens": 5, "messages": QUESTION, "stream": True, **GREEDY}
    with httpx.stream("POST", server.url + "/v1/messages", json=body, timeout=60) as r:
        events = [line[7:] for line in r.iter_lines() if line.startswith("event: ")]
    assert events[0] == "message_start"
    assert events[1] == "content_block_start" and set(events[2:-3]) == {"content_block_delta"}
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_anthropic_prefill_continues_the_assistant_turn(claude):
    out = claude.messages.create(model="any", max_tokens=8, messages=QUESTION + [
        {"role": "assistant", "content": "The capital of France is"}], extra_body=GREEDY)
    assert out.content[0].text.lstrip().startswith("Paris")


def test_reasoning_becomes_thinking_blocks(claude):
    """A prompt that ends inside <think> (as reasoning models' templates do; here through a prefill) makes
    the output reasoning until </think>: Anthropic thinking blocks, streamed as thinking deltas."""
    kwargs = dict(model="any", max_tokens=8, extra_body=GREEDY,
                  messages=QUESTION + [{"role": "assistant", "content": "<think>"}])
    out = claude.messages.create(**kwargs)
    assert [b.type for b in out.content] == ["thinking"] and out.content[0].thinking.strip()
    with claude.messages.stream(**kwargs) as stream:
        deltas = [e.delta.type for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert set(deltas) == {"thinking_delta"} and final.content[0].thinking == out.content[0].thinking


# --- batching: concurrent streams ---------------------------------------------------------------------

PROMPTS = ["Write a haiku about the sea.", "What is 12 times 12?", "Name three primary colors.",
           "Give me a word that rhymes with cat.", "Who wrote Hamlet?", "What is the boiling point of water?",
           "Translate 'good morning' to Spanish.", "List two planets."]


def test_eight_concurrent_greedy_streams_match_each_alone(server, oai):
    def ask(prompt: str, stream: bool) -> str:
        kwargs = dict(model="any", messages=[{"role": "user", "content": prompt}], max_tokens=24, **GREEDY)
        if stream:
            return _stream_text(oai.chat.completions.create(stream=True, **kwargs))[0]
        return oai.chat.completions.create(**kwargs).choices[0].message.content

    alone = [ask(p, stream=False) for p in PROMPTS]
    batched_before = metric(server.url, "cobatch_batched_decode_steps_total")
    with ThreadPoolExecutor(len(PROMPTS)) as pool:
        together = list(pool.map(lambda p: ask(p, stream=True), PROMPTS))
    assert together == alone
    batched_after = metric(server.url, "cobatch_batched_decode_steps_total")
    assert batched_after > batched_before      # they really were decoded together


# --- streaming text: stop strings and UTF-8 ------------------------------------------------------------

def test_stop_string_across_token_boundaries(server, oai, claude):
    prompt = "Once upon a time, in a small village by the sea, there lived"
    full = oai.completions.create(model="any", prompt=prompt, max_tokens=30, logprobs=0, **GREEDY).choices[0]
    tokens = full.logprobs.tokens
    # A stop string that starts inside one token and ends inside a later one.
    for i in range(3, len(tokens) - 3):
        a, b, c = tokens[i], tokens[i + 1], tokens[i + 2]
        if len(a) >= 2 and len(c) >= 2:
            stop = a[-1] + b + c[:1]
            start = full.text.find(stop)
            if start == len("".join(tokens[:i + 1])) - 1:
                break
    else:
        pytest.skip("no suitable token triple in the output")
    expected = full.text[:start]
    chunks, finish = [], None
    for chunk in oai.completions.create(model="any", prompt=prompt, max_tokens=30, stop=[stop, "zzz-never"],
                                        stream=True, **GREEDY):
        chunks.append(chunk.choices[0].text)
        finish = chunk.choices[0].finish_reason or finish
    assert "".join(chunks) == expected and finish == "stop"
    assert not any(stop in ch for ch in chunks)

    # The same through the Anthropic route (chat prompt, so a different text): the stop sequence is named.
    plain = claude.messages.create(model="any", max_tokens=20, messages=QUESTION, extra_body=GREEDY).content[0].text
    cut = plain.index("Paris")
    out = claude.messages.create(model="any", max_tokens=20, messages=QUESTION, stop_sequences=["Par"],
                                 extra_body=GREEDY)
    assert out.stop_reason == "stop_sequence" and out.stop_sequence == "Par"
    assert out.content[0].text == plain[:cut]


def test_multibyte_characters_are_never_split(oai):
    prompt = "Les émojis: 😀 😃 😄 😁 😆 😅"
    plain = oai.completions.create(model="any", prompt=prompt, max_tokens=24, logprobs=0, **GREEDY).choices[0]
    assert any(ord(ch) > 0xFFFF for ch in plain.text)               # it does produce emoji
    chunks = [c.choices[0].text for c in oai.completions.create(model="any", prompt=prompt, max_tokens=24,
                                                                  stream=True, **GREEDY)]
    assert "".join(chunks) == plain.text
    assert not any("\ufffd" in c for c in chunks)
    # Byte-level tokens split each emoji (a token alone is not valid UTF-8), so fewer chunks than tokens
    # carried text: nothing was sent while a character was still incomplete.
    assert any("\ufffd" in t for t in plain.logprobs.tokens)
    assert len([c for c in chunks if c]) < 24


# --- observability -----------------------------------------------------------------------------------

def test_metrics_counters_move(server, oai):
    url = server.url
    names = ["cobatch_requests_total", "cobatch_prompt_tokens_total", "cobatch_generation_tokens_total",
             "cobatch_time_to_first_token_seconds_count", "cobatch_inter_token_latency_seconds_count",
             "cobatch_decode_steps_total", "cobatch_engine_steps_total", "cobatch_prefix_cache_hit_tokens_total"]
    labels = {"cobatch_requests_total": {"api": "chat", "finish_reason": "length"}}
    before = {n: metric(url, n, labels.get(n)) for n in names}
    out = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=5, **GREEDY)
    after = {n: metric(url, n, labels.get(n)) for n in names}
    assert after["cobatch_requests_total"] == before["cobatch_requests_total"] + 1
    assert after["cobatch_prompt_tokens_total"] - before["cobatch_prompt_tokens_total"] == out.usage.prompt_tokens
    assert after["cobatch_generation_tokens_total"] - before["cobatch_generation_tokens_total"] == 5
    assert after["cobatch_time_to_first_token_seconds_count"] == before["cobatch_time_to_first_token_seconds_count"] + 1
    assert after["cobatch_inter_token_latency_seconds_count"] - before["cobatch_inter_token_latency_seconds_count"] == 4
    assert after["cobatch_decode_steps_total"] - before["cobatch_decode_steps_total"] >= 4
    assert after["cobatch_prefix_cache_hit_tokens_total"] - before["cobatch_prefix_cache_hit_tokens_total"] \
        == out.usage.prompt_tokens_details.cached_tokens
    text = httpx.get(url + "/metrics").text
    for name in ("cobatch_kv_usage_ratio", "cobatch_queue_depth", "cobatch_batched_decode_fraction",
                 'cobatch_lone_decode_steps_total{cause="no_peer"}',
                 'cobatch_lone_decode_steps_total{cause="peer_prefill"}',
                 'cobatch_lone_decode_steps_total{cause="peer_finish"}', "cobatch_inter_token_latency_seconds_bucket"):
        assert name in text
    pool = server.context.llm.engine.pool       # the CPU test server's cache: float32, the activations' dtype
    info = (f'cobatch_kv_cache_info{{block_size="{pool.block_size}",dtype="float32",'
            f'tokens="{pool.num_blocks * pool.block_size}"}} 1.0')
    assert info in text, [line for line in text.splitlines() if "kv_cache_info" in line]


def test_slots_show_a_running_request(server):
    stream = RawStream(server.url, "/v1/chat/completions", {"messages": QUESTION, "max_tokens": 200,
                                                            "ignore_eos": True, "stream": True})
    try:
        stream.read_events(3)
        view = slots(server.url)
        busy = [s for s in view["slots"] if s["state"] != "idle"]
        assert len(busy) == 1 and busy[0]["state"] == "decoding"
        assert busy[0]["prompt_tokens"] > 0 and busy[0]["generated_tokens"] >= 2
        assert "global" in view["prefix_cache"]["scope"]
        assert view["kv_blocks"]["used"] >= 1
    finally:
        stream.hard_close()
    wait_for(lambda: all_slots_idle(server.url), what="the slot to be freed")


# --- n choices ------------------------------------------------------------------------------------------

SAMPLED = {"temperature": 1.0, "max_tokens": 8}


def test_n_choices_are_the_seeded_single_requests(oai):
    """Choice i of a seeded request is what the same request with n = 1 and seed + i gives (sampling noise is
    counter-based, so a choice does not depend on what it is batched with); the prompt is counted once."""
    many = oai.chat.completions.create(model="any", messages=QUESTION, n=3, seed=1234, **SAMPLED)
    singles = [oai.chat.completions.create(model="any", messages=QUESTION, seed=1234 + i, **SAMPLED)
               for i in range(3)]
    assert [c.index for c in many.choices] == [0, 1, 2]
    assert [c.message.content for c in many.choices] == [s.choices[0].message.content for s in singles]
    assert len({s.choices[0].message.content for s in singles}) > 1, "seed + i should give different samples"
    assert many.usage.prompt_tokens == singles[0].usage.prompt_tokens
    assert many.usage.completion_tokens == sum(s.usage.completion_tokens for s in singles)

    stream = oai.chat.completions.create(model="any", messages=QUESTION, n=3, seed=1234, stream=True,
                                         stream_options={"include_usage": True}, **SAMPLED)
    texts, finishes, usage = {}, {}, None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] = texts.get(choice.index, "") + (choice.delta.content or "")
            finishes[choice.index] = choice.finish_reason or finishes.get(choice.index)
    assert texts == {i: c.message.content for i, c in enumerate(many.choices)}
    assert finishes == {i: c.finish_reason for i, c in enumerate(many.choices)}
    assert usage.completion_tokens == many.usage.completion_tokens

    text = oai.completions.create(model="any", prompt="The capital of France is", n=2, seed=7, **SAMPLED)
    alone = [oai.completions.create(model="any", prompt="The capital of France is", seed=7 + i, **SAMPLED)
             for i in range(2)]
    assert [c.text for c in text.choices] == [a.choices[0].text for a in alone]


def test_completions_with_several_prompts(oai):
    """A list of prompts: n choices each, indexed prompt-major, each as the prompt alone would give it."""
    prompts = ["The capital of France is", "One, two, three,"]
    alone = [oai.completions.create(model="any", prompt=p, max_tokens=6, **GREEDY) for p in prompts]
    both = oai.completions.create(model="any", prompt=prompts, n=2, max_tokens=6, echo=True, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1, 2, 3]
    assert [c.text for c in both.choices] == [p + a.choices[0].text for p, a in zip(prompts, alone) for _ in "ab"]
    assert both.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert both.usage.completion_tokens == 2 * sum(a.usage.completion_tokens for a in alone)
    ids = oai.completions.create(model="any", prompt=[[1, 2, 3], [4, 5]], max_tokens=2, **GREEDY)
    assert len(ids.choices) == 2 and ids.usage.prompt_tokens == 5


def test_n_choices_that_do_not_all_fit_are_429_and_leave_nothing_running(server, oai):
    worker = server.context.worker
    aborted = {"api": "chat", "finish_reason": "abort"}
    before = metric(server.url, "cobatch_requests_total", aborted)
    saved, worker.max_queue = worker.max_queue, 0
    try:
        with pytest.raises(openai.RateLimitError):
            oai.chat.completions.create(model="any", messages=QUESTION, n=worker.num_slots + 1, max_tokens=1000,
                                        extra_body={"ignore_eos": True})
    finally:
        worker.max_queue = saved
    assert metric(server.url, "cobatch_requests_total", aborted) == before + worker.num_slots
    wait_for(lambda: all_slots_idle(server.url), what="the choices that were started to be aborted")


# --- response_format ------------------------------------------------------------------------------------

CITY = {"type": "object", "additionalProperties": False, "required": ["country", "capital"],
        "properties": {"country": {"type": "string", "maxLength": 20}, "capital": {"type": "string", "maxLength": 20}}}


def test_response_format_json_schema_and_json_object(oai):
    pytest.importorskip("llguidance")
    ask = [{"role": "user", "content": "What is the capital of France? Answer in JSON."}]
    fmt = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
    plain = oai.chat.completions.create(model="any", messages=ask, response_format=fmt, max_tokens=60, **GREEDY)
    value = json.loads(plain.choices[0].message.content)
    assert set(value) == {"country", "capital"} and all(isinstance(v, str) for v in value.values())
    assert plain.choices[0].finish_reason == "stop"
    stream = oai.chat.completions.create(model="any", messages=ask, response_format=fmt, max_tokens=60, stream=True,
                                         **GREEDY)
    assert _stream_text(stream)[0] == plain.choices[0].message.content

    text = oai.completions.create(model="any", prompt="A JSON object describing a cat:", max_tokens=60,
                                  extra_body={"response_format": {"type": "json_object"}}, **GREEDY)
    assert isinstance(json.loads(text.choices[0].text), dict)


def test_structured_outputs_as_vllm_and_llama_cpp_take_them(oai):
    """vLLM's structured_outputs (and its older guided_* fields) and llama.cpp's grammar / json_schema: each
    output is checked against its constraint by Python's own parser, not by llguidance."""
    pytest.importorskip("llguidance")
    ask = [{"role": "user", "content": "Is Paris in France? Answer yes or no."}]
    choice = oai.chat.completions.create(model="any", messages=ask, max_tokens=10, **GREEDY,
                                         extra_body={"structured_outputs": {"choice": ["yes", "no"]}})
    assert choice.choices[0].message.content in ("yes", "no") and choice.choices[0].finish_reason == "stop"
    legacy = oai.chat.completions.create(model="any", messages=ask, max_tokens=10, **GREEDY,
                                         extra_body={"guided_choice": ["yes", "no"]})
    assert legacy.choices[0].message.content == choice.choices[0].message.content

    year = r" ?1[0-9]{3}"
    plain = oai.completions.create(model="any", prompt="The Eiffel Tower was finished in the year", max_tokens=8,
                                   extra_body={"structured_outputs": {"regex": year}}, **GREEDY)
    assert re.fullmatch(year, plain.choices[0].text) and plain.choices[0].finish_reason == "stop"
    streamed = oai.completions.create(model="any", prompt="The Eiffel Tower was finished in the year", max_tokens=8,
                                      extra_body={"guided_regex": year}, stream=True, **GREEDY)
    assert _stream_text(streamed)[0] == plain.choices[0].text

    gbnf = 'root ::= ("red" | "green" | "blue") "!"'     # llama.cpp's `grammar` field, GBNF
    color = oai.chat.completions.create(model="any", messages=[{"role": "user", "content": "Name a color."}],
                                        max_tokens=10, extra_body={"grammar": gbnf}, **GREEDY)
    assert color.choices[0].message.content in ("red!", "green!", "blue!")

    for body in ({"guided_json": json.dumps(CITY)}, {"json_schema": CITY}, {"structured_outputs": {"json": CITY}}):
        out = oai.completions.create(model="any", prompt="France as JSON:", max_tokens=60, extra_body=body, **GREEDY)
        value = json.loads(out.choices[0].text)
        assert set(value) == {"country", "capital"} and all(isinstance(v, str) for v in value.values()), body
    anything = oai.completions.create(model="any", prompt="A cat as JSON:", max_tokens=60, **GREEDY,
                                      extra_body={"structured_outputs": {"json_object": True}})
    assert isinstance(json.loads(anything.choices[0].text), dict)


def test_embeddings_through_the_openai_client(server, oai, caplog):
    """The client asks for base64 by default and decodes it; float must agree. A text and its token ids give
    the same vector, as does an input alone and inside a batch. (transformers checks the values:
    test_reference.py.) The request log has no time to first token for them ("-", not "nan")."""
    texts = ["The cat sat on the mat.", "A cat was sitting on a mat.", "Stock markets fell sharply today."]
    caplog.set_level(logging.INFO, logger="cobatch.server.requests")
    batch = oai.embeddings.create(model="any", input=texts)
    logged = wait_for(lambda: [r.getMessage() for r in caplog.records if r.getMessage().startswith("embeddings ")],
                      what="the embeddings request's log line")
    assert all(" ttft=- " in line and "nan" not in line for line in logged), logged
    width = server.context.llm.config.d_model
    assert [d.index for d in batch.data] == [0, 1, 2] and all(len(d.embedding) == width for d in batch.data)
    for d in batch.data:
        assert abs(sum(v * v for v in d.embedding) - 1) < 1e-4           # unit length
    ids = [server.context.llm.encode_prompt(t) for t in texts]
    assert batch.usage.prompt_tokens == batch.usage.total_tokens == sum(len(i) for i in ids)
    alone = oai.embeddings.create(model="any", input=texts[2], encoding_format="float").data[0].embedding
    as_ids = oai.embeddings.create(model="any", input=ids[2], encoding_format="float").data[0].embedding
    for other in (alone, as_ids):
        assert max(abs(a - b) for a, b in zip(other, batch.data[2].embedding)) < 1e-5
    similar = sum(a * b for a, b in zip(batch.data[0].embedding, batch.data[1].embedding))
    unrelated = sum(a * b for a, b in zip(batch.data[0].embedding, batch.data[2].embedding))
    assert similar > unrelated


def test_logprobs_name_tokens_by_id_with_vllms_flag(server, oai):
    """vLLM's --return-tokens-as-token-ids: logprobs name each token "token_id:ID" (the ids return_token_ids
    gives), chat and completions alike; a request asking otherwise than the server was started is a 400."""
    kwargs = dict(model="any", messages=QUESTION, max_tokens=4, logprobs=True, top_logprobs=2, **GREEDY,
                  extra_body={"return_token_ids": True})
    plain = oai.chat.completions.create(**kwargs)
    options = server.context.options
    options.tokens_as_ids = True
    try:
        named = oai.chat.completions.create(**kwargs)
        ids = named.choices[0].model_extra["token_ids"]
        entries = named.choices[0].logprobs.content
        assert [e.token for e in entries] == [f"token_id:{i}" for i in ids]
        assert all(e.top_logprobs[0].token == e.token and bytes(e.bytes) == e.token.encode() for e in entries)
        assert [e.logprob for e in entries] == [e.logprob for e in plain.choices[0].logprobs.content]
        completion = oai.completions.create(model="any", prompt="The capital of France is", max_tokens=3, logprobs=1,
                                            **GREEDY, extra_body={"return_token_ids": True,
                                                                  "return_tokens_as_token_ids": True})
        assert completion.choices[0].logprobs.tokens == [
            f"token_id:{i}" for i in completion.choices[0].model_extra["token_ids"]]
    finally:
        options.tokens_as_ids = False
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(**{**kwargs, "extra_body": {"return_tokens_as_token_ids": True}})
    assert err.value.body["param"] == "return_tokens_as_token_ids"


def test_echo_with_logprobs_scores_the_prompt(oai):
    """lm-eval-harness' loglikelihood request: echo, logprobs and max_tokens 0 give each prompt token's logprob."""
    prompt = "The capital of France is Paris"
    r = oai.completions.create(model="any", prompt=prompt, max_tokens=0, echo=True, logprobs=1)
    choice = r.choices[0]
    assert choice.text == prompt and choice.finish_reason == "length" and r.usage.completion_tokens == 0
    lp = choice.logprobs
    assert "".join(lp.tokens) == prompt and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(x < 0 for x in lp.token_logprobs[1:]) and all(len(t) == 1 for t in lp.top_logprobs[1:])
    # The last prompt token's logprob is what the sampler reports when it generates that token.
    gen = oai.completions.create(model="any", prompt="The capital of France is", max_tokens=1, logprobs=1, **GREEDY)
    assert gen.choices[0].text == " Paris"
    assert abs(gen.choices[0].logprobs.token_logprobs[0] - lp.token_logprobs[-1]) < 1e-4
    stream = oai.completions.create(model="any", prompt=prompt, max_tokens=2, echo=True, logprobs=1, stream=True,
                                    **GREEDY)
    first = next(iter(stream)).choices[0]
    assert first.text == prompt and first.logprobs.token_logprobs == lp.token_logprobs


def test_prompt_logprobs_as_vllm_reports_them(server, oai):
    """vLLM's prompt_logprobs: None for the first prompt token, then each token keyed by its id with its logprob,
    rank and text, beside its k likeliest alternatives (ranks 1..k); the logprobs echo scores the prompt with,
    and the rank transformers' logits give (tests/test_reference.py checks the engine's against them)."""
    tokenizer = server.context.llm.tokenizer
    prompt = "The capital of France is Paris"
    ids = tokenizer.encode(prompt)
    r = oai.completions.create(model="any", prompt=ids, max_tokens=1, extra_body={"prompt_logprobs": 2}, **GREEDY)
    got = r.choices[0].model_extra["prompt_logprobs"]
    scored = oai.completions.create(model="any", prompt=ids, max_tokens=0, echo=True, logprobs=2).choices[0].logprobs
    assert r.choices[0].logprobs is None and got[0] is None and len(got) == len(ids) == len(scored.tokens)
    for i, entry in enumerate(got[1:], start=1):
        mine = entry[str(ids[i])]
        assert abs(mine["logprob"] - scored.token_logprobs[i]) < 1e-4
        assert mine["decoded_token"] == tokenizer.decode([ids[i]])
        alternatives = sorted(entry.values(), key=lambda e: e["rank"])
        assert [e["rank"] for e in alternatives][:2] == [1, 2] and len(entry) in (2, 3)
        assert alternatives[0]["logprob"] >= alternatives[1]["logprob"] >= alternatives[-1]["logprob"]
        # the prompt token's rank: 1 + the alternatives more likely than it (all of them when it is not among them)
        assert mine["rank"] == 1 + sum(e["logprob"] > mine["logprob"] for e in alternatives[:2]) or (
            len(entry) == 3 and mine["rank"] > 2)
    chat = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=1, extra_body={
        "prompt_logprobs": 0})
    prompt_entries = chat.model_extra["prompt_logprobs"]
    assert len(prompt_entries) == chat.usage.prompt_tokens and prompt_entries[0] is None
    assert all(len(e) == 1 and next(iter(e.values()))["logprob"] <= 0 for e in prompt_entries[1:])
    with pytest.raises(openai.BadRequestError) as err:        # as vLLM: not when streaming
        oai.completions.create(model="any", prompt=prompt, max_tokens=1, stream=True,
                               extra_body={"prompt_logprobs": 1})
    assert err.value.body["param"] == "prompt_logprobs"
    # with echo's own logprobs: each keeps its own count of alternatives
    both = oai.completions.create(model="any", prompt=ids, max_tokens=0, echo=True, logprobs=1,
                                  extra_body={"prompt_logprobs": 3}).choices[0]
    assert all(len(top) == 1 for top in both.logprobs.top_logprobs[1:])
    assert all(len(entry) in (3, 4) for entry in both.model_extra["prompt_logprobs"][1:])
    assert both.logprobs.token_logprobs[1:] == scored.token_logprobs[1:]


def test_return_token_ids_as_vllm_gives_them(server, oai):
    """vLLM's return_token_ids: the prompt's ids (top level on chat, per choice on completions) and each choice's
    sampled ids, whose text is the answer's; streamed, the prompt's on the first chunk and each chunk's own."""
    tokenizer = server.context.llm.tokenizer
    chat = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=12, n=2, seed=4, temperature=0.8,
                                       extra_body={"return_token_ids": True})
    prompt_ids = chat.model_extra["prompt_token_ids"]
    assert len(prompt_ids) == chat.usage.prompt_tokens and "capital of France" in tokenizer.decode(prompt_ids)
    for choice in chat.choices:
        ids = choice.model_extra["token_ids"]
        assert tokenizer.decode(ids, skip_special=True) == choice.message.content
    assert sum(len(c.model_extra["token_ids"]) for c in chat.choices) == chat.usage.completion_tokens
    streamed = list(oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=12, seed=4,
                                                temperature=0.8, stream=True, extra_body={"return_token_ids": True}))
    assert streamed[0].model_extra["prompt_token_ids"] == prompt_ids
    assert [t for c in streamed for t in c.choices[0].model_extra["token_ids"]] == \
        chat.choices[0].model_extra["token_ids"]
    plain = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=2)
    assert "prompt_token_ids" not in (plain.model_extra or {})

    ids = tokenizer.encode("The capital of France is")
    done = oai.completions.create(model="any", prompt=ids, max_tokens=5, extra_body={"return_token_ids": True},
                                  **GREEDY).choices[0]
    assert done.model_extra["prompt_token_ids"] == ids and tokenizer.decode(done.model_extra["token_ids"]) == done.text
    chunks = list(oai.completions.create(model="any", prompt=ids, max_tokens=5, stream=True, **GREEDY,
                                         extra_body={"return_token_ids": True}))
    assert chunks[0].choices[0].model_extra["prompt_token_ids"] == ids
    assert [t for c in chunks for t in c.choices[0].model_extra["token_ids"]] == done.model_extra["token_ids"]


# --- the Responses API ----------------------------------------------------------------------------------

def test_responses_api_plain_streamed_incomplete_and_json(oai):
    r = oai.responses.create(model="any", input="What is the capital of France?", max_output_tokens=30, **GREEDY)
    assert r.status == "completed" and r.output[0].type == "message" and "Paris" in r.output_text
    chat = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=30, **GREEDY)
    assert r.output_text == chat.choices[0].message.content           # the same prompt through the same template
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)

    events = list(oai.responses.create(model="any", input=QUESTION, max_output_tokens=30, stream=True, **GREEDY))
    types = [e.type for e in events]
    assert types[:2] == ["response.created", "response.in_progress"] and types[-1] == "response.completed"
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == r.output_text == events[-1].response.output_text

    short = oai.responses.create(model="any", input="Describe Paris.", max_output_tokens=3, **GREEDY)
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"
    assert short.usage.output_tokens == 3
    told = oai.responses.create(model="any", input="Describe Paris.", instructions="Be brief.", max_output_tokens=3,
                                **GREEDY)
    as_chat = oai.chat.completions.create(model="any", max_tokens=3, **GREEDY, messages=[
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Describe Paris."}])
    assert told.usage.input_tokens == as_chat.usage.prompt_tokens          # instructions are the system message
    assert told.output_text == as_chat.choices[0].message.content

    pytest.importorskip("llguidance")
    fmt = {"format": {"type": "json_schema", "name": "city", "schema": CITY}}
    structured = oai.responses.create(model="any", input="What is the capital of France? Answer in JSON.", text=fmt,
                                      max_output_tokens=60, **GREEDY)
    assert set(json.loads(structured.output_text)) == {"country", "capital"}


def test_responses_are_stored_continued_retrieved_and_deleted(server, oai):
    """A stored response (OpenAI's default) is continued by previous_response_id: the model reads the earlier turn
    as if the client had sent it again (the same prompt tokens, the same greedy answer); store=false keeps
    nothing; a deleted response can be neither retrieved nor continued."""
    first = oai.responses.create(model="any", input="My name is Ada. Say hi.", instructions="Be brief.",
                                 max_output_tokens=12, **GREEDY)
    assert first.store and oai.responses.retrieve(first.id).output_text == first.output_text
    follow = oai.responses.create(model="any", input="What is my name?", previous_response_id=first.id,
                                  instructions="Answer in one word.", max_output_tokens=8, **GREEDY)
    assert follow.previous_response_id == first.id
    resent = oai.responses.create(model="any", instructions="Answer in one word.", max_output_tokens=8, **GREEDY,
                                  input=[{"role": "user", "content": "My name is Ada. Say hi."},
                                         {"role": "assistant", "content": first.output_text},
                                         {"role": "user", "content": "What is my name?"}], store=False)
    assert follow.usage.input_tokens == resent.usage.input_tokens and follow.output_text == resent.output_text
    assert not resent.store
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(resent.id)

    # a chain of three: the second's conversation carries the first's
    third = oai.responses.create(model="any", input="And again?", previous_response_id=follow.id,
                                 max_output_tokens=4, **GREEDY)
    assert third.usage.input_tokens > follow.usage.input_tokens + 5
    deleted = httpx.delete(f"{server.url}/v1/responses/{first.id}", timeout=30)
    assert deleted.json() == {"id": first.id, "object": "response", "deleted": True}
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(first.id)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="any", input="Hi", previous_response_id=first.id, max_output_tokens=2)
    assert exc.value.body["param"] == "previous_response_id"


def test_responses_truncation_auto_drops_the_oldest_turns_until_the_input_fits(oai):
    """truncation "auto" keeps the instructions and the longest tail of the conversation that fits the context
    (1,024 here), as OpenAI's; "disabled" (the default) answers 400. The tail is found here by sending shorter and
    shorter tails whole."""
    story = " ".join(f"Fact {i}: the number {i} comes after {i - 1}." for i in range(1, 12))
    items = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"Turn {i}. {story}"} for i in range(13)]
    kwargs = dict(model="any", instructions="Be brief.", max_output_tokens=1, store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(input=items, **kwargs)
    assert exc.value.body["code"] == "context_length_exceeded"
    cut = oai.responses.create(input=items, truncation="auto", **kwargs)
    for start in range(1, len(items)):
        try:
            tail = oai.responses.create(input=items[start:], **kwargs)
            break
        except openai.BadRequestError:
            continue
    assert start > 1 and cut.usage.input_tokens == tail.usage.input_tokens < 1024
    assert cut.truncation == "auto" and tail.truncation == "disabled"


@pytest.mark.parametrize("extra", [{"background": True}, {"prompt": {"id": "pmpt_1"}}, {"conversation": "conv_1"},
                                   {"top_logprobs": 2}])
def test_responses_refuse_what_only_openai_runs(oai, extra):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="any", input="Hi", max_output_tokens=2, extra_body=extra)
    assert exc.value.body["param"] == next(iter(extra))


# --- tokenize / detokenize ------------------------------------------------------------------------------

def test_tokenize_and_detokenize(server, oai):
    r = httpx.post(server.url + "/tokenize", json={"prompt": "Hello world, hello tokens!"}).json()
    assert r["count"] == len(r["tokens"]) > 3 and r["max_model_len"] == 1024
    assert httpx.post(server.url + "/detokenize", json={"tokens": r["tokens"]}).json() == \
        {"prompt": "Hello world, hello tokens!", "content": "Hello world, hello tokens!"}
    cpp = httpx.post(server.url + "/tokenize", json={"content": "Hello world, hello tokens!", "with_pieces": True})
    assert cpp.json()["tokens"] == r["tokens"] and "".join(cpp.json()["token_strs"]).replace("Ġ", " ") == \
        "Hello world, hello tokens!"
    chat = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()
    reply = oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens
    # llama.cpp's /apply-template: the text the model reads, which tokenizes to the chat's prompt ids
    prompt = httpx.post(server.url + "/apply-template", json={"messages": QUESTION}).json()["prompt"]
    assert QUESTION[-1]["content"] in prompt
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": prompt, "add_special": False}).json()
    assert tokenized["tokens"] == chat["tokens"]
    for path, body, param in [("/tokenize", {}, "prompt"),
                              ("/tokenize", {"prompt": "a", "messages": QUESTION}, "prompt"),
                              ("/apply-template", {}, "messages"),
                              ("/detokenize", {"tokens": [1, 10 ** 9]}, "tokens"), ("/detokenize", {}, "tokens")]:
        bad = httpx.post(server.url + path, json=body)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == param, (path, body, bad.text)


# --- errors --------------------------------------------------------------------------------------------

CHAT = "/v1/chat/completions"
MESSAGES = "/v1/messages"
OK_CHAT = {"messages": QUESTION, "max_tokens": 2}
OK_MSG = {"model": "m", "max_tokens": 2, "messages": QUESTION}

ERROR_CASES = [
    ("malformed json", "POST", CHAT, b'{"messages": [', 400, None),
    ("not an object", "POST", CHAT, b"[1, 2]", 400, None),
    ("JSON nested too deeply", "POST", CHAT, b'{"messages": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", 400, None),
    ("lone surrogate escape", "POST", CHAT, b'{"messages": [{"role": "user", "content": "a\\ud800"}]}', 400, None),
    ("no messages", "POST", CHAT, {"model": "m"}, 400, "messages"),
    ("empty messages", "POST", CHAT, {"messages": []}, 400, "messages"),
    ("bad role", "POST", CHAT, {"messages": [{"role": "wizard", "content": "hi"}]}, 400, None),
    ("temperature too high", "POST", CHAT, {**OK_CHAT, "temperature": 7}, 400, "temperature"),
    ("temperature not a number", "POST", CHAT, {**OK_CHAT, "temperature": "hot"}, 400, "temperature"),
    ("top_p zero", "POST", CHAT, {**OK_CHAT, "top_p": 0}, 400, "top_p"),
    ("negative max_tokens", "POST", CHAT, {**OK_CHAT, "max_tokens": -1}, 400, "max_tokens"),
    ("n above the limit", "POST", CHAT, {**OK_CHAT, "n": 17}, 400, "n"),
    ("n zero", "POST", "/v1/completions", {"prompt": "a", "n": 0}, 400, "n"),
    ("min_tokens over max_tokens", "POST", CHAT, {**OK_CHAT, "min_tokens": 5}, 400, "min_tokens"),
    ("stop_token_ids out of vocab", "POST", CHAT, {**OK_CHAT, "stop_token_ids": [10 ** 7]}, 400, "stop_token_ids"),
    ("allowed_token_ids out of vocab", "POST", CHAT, {**OK_CHAT, "allowed_token_ids": [3, 10 ** 7]}, 400,
     "allowed_token_ids"),
    ("empty bad word", "POST", "/v1/completions", {"prompt": "a", "bad_words": ["ok", " "]}, 400, "bad_words.1"),
    ("truncate_prompt_tokens zero", "POST", CHAT, {**OK_CHAT, "truncate_prompt_tokens": 0}, 400,
     "truncate_prompt_tokens"),
    ("top_logprobs without logprobs", "POST", CHAT, {**OK_CHAT, "top_logprobs": 3}, 400, "top_logprobs"),
    ("too many top_logprobs", "POST", CHAT, {**OK_CHAT, "logprobs": True, "top_logprobs": 99}, 400, "top_logprobs"),
    ("penalty out of range", "POST", CHAT, {**OK_CHAT, "presence_penalty": 3}, 400, "presence_penalty"),
    ("logit_bias key not a token id", "POST", CHAT, {**OK_CHAT, "logit_bias": {"hello": 1}}, 400, "logit_bias"),
    ("logit_bias token out of vocab", "POST", CHAT, {**OK_CHAT, "logit_bias": {"999999999": 1}}, 400, "logit_bias"),
    ("logit_bias value out of range", "POST", "/v1/completions", {"prompt": "a", "logit_bias": {"5": 101}}, 400,
     "logit_bias"),
    ("image content", "POST", CHAT, {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "http://x"}}]}]}, 400, "messages.0.content.0"),
    ("bad tool arguments", "POST", CHAT, {"messages": [QUESTION[0], {"role": "assistant", "tool_calls": [
        {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}, 400, None),
    ("json_schema response_format without a schema object", "POST", CHAT,
     {**OK_CHAT, "response_format": {"type": "json_schema"}}, 400, "response_format"),
    ("response_format of an unknown type", "POST", CHAT, {**OK_CHAT, "response_format": {"type": "yaml"}}, 400,
     "response_format"),
    ("response_format schema that does not compile", "POST", "/v1/completions",
     {"prompt": "a", "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "nope"}}}}, 400,
     "response_format"),
    ("two structured outputs", "POST", CHAT, {**OK_CHAT, "guided_regex": "a", "guided_choice": ["a"]}, 400,
     "guided_choice"),
    ("a structured output and a JSON response_format", "POST", CHAT,
     {**OK_CHAT, "guided_regex": "a+", "response_format": {"type": "json_object"}}, 400, "guided_regex"),
    ("a structured output and a forced tool call", "POST", CHAT, {**OK_CHAT, "structured_outputs": {"regex": "a"},
     "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required"}, 400,
     "structured_outputs.regex"),
    ("a regex that does not compile", "POST", CHAT, {**OK_CHAT, "structured_outputs": {"regex": "(("}}, 400,
     "structured_outputs.regex"),
    ("GBNF that does not parse", "POST", "/v1/completions", {"prompt": "a", "grammar": "root ::= (("}, 400,
     "grammar"),
    ("an empty choice list", "POST", CHAT, {**OK_CHAT, "guided_choice": []}, 400, "guided_choice"),
    ("a JSON schema that is not JSON", "POST", CHAT, {**OK_CHAT, "guided_json": "{not json"}, 400, "guided_json"),
    ("an unknown structured output", "POST", CHAT, {**OK_CHAT, "structured_outputs": {"yaml": "x"}}, 400,
     "structured_outputs"),
    ("a structured output of the wrong type", "POST", CHAT, {**OK_CHAT, "structured_outputs": {"regex": 5}}, 400,
     "structured_outputs.regex"),
    ("embeddings without input", "POST", "/v1/embeddings", {"model": "m"}, 400, "input"),
    ("embeddings of an empty list", "POST", "/v1/embeddings", {"input": []}, 400, "input"),
    ("embeddings of an empty text", "POST", "/v1/embeddings", {"input": ""}, 400, "input"),
    ("embeddings token out of vocab", "POST", "/v1/embeddings", {"input": [[1, 10 ** 9]]}, 400, "input"),
    ("embeddings of too many inputs", "POST", "/v1/embeddings", {"input": ["a"] * 65}, 400, "input"),
    ("embeddings in fewer dimensions", "POST", "/v1/embeddings", {"input": "a", "dimensions": 8}, 400, "dimensions"),
    ("embeddings in an unknown encoding", "POST", "/v1/embeddings", {"input": "a", "encoding_format": "hex"}, 400,
     "encoding_format"),
    ("embeddings of a text over the context", "POST", "/v1/embeddings", {"input": "hello " * 2000}, 400, "input"),
    ("llama.cpp infill on a model without fill-in-the-middle tokens", "POST", "/infill", {"input_prefix": "a"}, 400,
     "input_suffix"),
    ("completion prompt token out of vocab", "POST", "/v1/completions", {"prompt": [1, 10 ** 9]}, 400, "prompt"),
    ("completion empty prompt", "POST", "/v1/completions", {"prompt": ""}, 400, "prompt"),
    ("suffix on a model without fill-in-the-middle tokens", "POST", "/v1/completions", {"prompt": "a", "suffix": "b"},
     400, "suffix"),
    ("responses without input", "POST", "/v1/responses", {"model": "m"}, 400, "input"),
    ("responses previous_response_id not stored", "POST", "/v1/responses",
     {"input": "hi", "previous_response_id": "resp_1"}, 400, "previous_response_id"),
    ("responses retrieved, not stored", "GET", "/v1/responses/resp_1", None, 404, "response_id"),
    ("responses deleted, not stored", "DELETE", "/v1/responses/resp_1", None, 404, "response_id"),
    ("responses image input", "POST", "/v1/responses", {"input": [{"role": "user", "content": [
        {"type": "input_image", "image_url": "http://x"}]}]}, 400, "input.0.content.0"),
    ("responses unknown input item", "POST", "/v1/responses", {"input": [{"type": "web_search_call"}]}, 400,
     "input.0"),
    ("responses bad text.format", "POST", "/v1/responses", {"input": "hi", "text": {"format": {"type": "yaml"}}},
     400, "text.format"),
    ("responses required without tools", "POST", "/v1/responses", {"input": "hi", "tool_choice": "required"}, 400,
     "tool_choice"),
    ("responses message content a number", "POST", "/v1/responses",
     {"input": [{"type": "message", "role": "user", "content": 5}]}, 400, "input.0.content"),
    ("responses content parts as strings", "POST", "/v1/responses",
     {"input": [{"type": "message", "role": "user", "content": ["hi"]}]}, 400, "input.0.content.0"),
    ("responses function output a number", "POST", "/v1/responses",
     {"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, 400, "input.0.output"),
    ("responses function arguments a number", "POST", "/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": 5}]}, 400,
     "input.0.function.arguments"),
    ("responses text.format a string", "POST", "/v1/responses", {"input": "hi", "text": {"format": "json"}}, 400,
     "text.format"),
    ("tool_choice function named by a string", "POST", CHAT, {**OK_CHAT, "tools": [
        {"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": "f"}}, 400,
     "tool_choice.function"),
    ("max_tokens 0 without echo", "POST", "/v1/completions", {"prompt": "a", "max_tokens": 0}, 400, "max_tokens"),
    ("completion too many prompts", "POST", "/v1/completions", {"prompt": ["a"] * 33, "n": 2}, 400, "prompt"),
    ("completion empty prompt list", "POST", "/v1/completions", {"prompt": []}, 400, "prompt"),
    ("completion bad id in a batched prompt", "POST", "/v1/completions", {"prompt": [[1, 2], [-1]]}, 400, "prompt"),
    ("unknown model id", "GET", "/v1/models/nope", None, 404, "model"),
    ("unknown route", "GET", "/v1/nothing-here", None, 404, None),
    ("wrong method", "GET", CHAT, None, 405, None),
    ("anthropic missing max_tokens", "POST", MESSAGES, {"model": "m", "messages": QUESTION}, 400, None),
    ("anthropic malformed json", "POST", MESSAGES, b"{", 400, None),
    ("anthropic lone surrogate escape", "POST", MESSAGES,
     b'{"model": "m", "max_tokens": 2, "messages": [{"role": "user", "content": "\\udfff"}]}', 400, None),
    ("anthropic bad block", "POST", MESSAGES, {**OK_MSG, "messages": [{"role": "user", "content": [
        {"type": "image", "source": {}}]}]}, 400, None),
    ("anthropic temperature > 1", "POST", MESSAGES, {**OK_MSG, "temperature": 1.5}, 400, None),
    ("anthropic tool_use input a string", "POST", MESSAGES, {**OK_MSG, "messages": [QUESTION[0], {
        "role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]}, 400, None),
    ("anthropic unknown tool_choice", "POST", MESSAGES, {**OK_MSG, "tools": [{"name": "f"}],
                                                        "tool_choice": {"type": "maybe"}}, 400, None),
    ("anthropic server tool", "POST", MESSAGES, {**OK_MSG, "tools": [{"type": "web_search_20250305",
                                                                    "name": "web_search"}]}, 400, None),
    ("anthropic remote MCP servers", "POST", MESSAGES, {**OK_MSG, "mcp_servers": [
        {"type": "url", "url": "https://example.com/mcp", "name": "x"}]}, 400, None),
    ("anthropic code container", "POST", MESSAGES, {**OK_MSG, "container": "container_1"}, 400, None),
    ("anthropic document citations", "POST", MESSAGES, {**OK_MSG, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "x"},
         "citations": {"enabled": True}}]}]}, 400, None),
    ("anthropic PDF document", "POST", MESSAGES, {**OK_MSG, "messages": [{"role": "user", "content": [
        {"type": "document", "source": {"type": "base64", "media_type": "application/pdf", "data": "AAAA"}}]}]},
     400, None),
    ("anthropic empty content list", "POST", MESSAGES, {**OK_MSG, "messages": [{"role": "user", "content": []}]},
     400, None),
    ("anthropic thinking budget not a number", "POST", MESSAGES,
     {**OK_MSG, "thinking": {"type": "enabled", "budget_tokens": "x"}}, 400, None),
    ("anthropic count_tokens no messages", "POST", MESSAGES + "/count_tokens", {"model": "m"}, 400, None),
    ("anthropic system text block without its text", "POST", MESSAGES, {**OK_MSG, "system": [{"type": "text"}]},
     400, None),
    ("anthropic tool_result answering no tool_use", "POST", MESSAGES, {**OK_MSG, "messages": [{
        "role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "42"}]}]}, 400, None),
    ("user message without content", "POST", CHAT, {"messages": [{"role": "user"}]}, 400, "messages.0.content"),
    ("content an empty list of parts", "POST", CHAT, {"messages": [{"role": "user", "content": []}]}, 400,
     "messages.0.content"),
    ("tool message answering no call", "POST", CHAT,
     {"messages": [{"role": "tool", "tool_call_id": "c", "content": "1"}]}, 400, "messages"),
    ("tool message naming a call the assistant did not make", "POST", CHAT, {"messages": [QUESTION[0], {
        "role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]},
        {"role": "tool", "tool_call_id": "b", "content": "1"}]}, 400, "messages"),
    ("allowed_token_ids empty", "POST", CHAT, {**OK_CHAT, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ("a grammar that nothing satisfies", "POST", CHAT, {**OK_CHAT, "grammar": "root ::= root"}, 400, "grammar"),
    ("a schema that nothing satisfies", "POST", "/v1/completions", {"prompt": "a", "response_format": {
        "type": "json_schema", "json_schema": {"schema": {"$defs": {"a": {"$ref": "#/$defs/a"}},
                                                         "$ref": "#/$defs/a"}}}}, 400, "response_format"),
    ("responses empty input list", "POST", "/v1/responses", {"input": []}, 400, "input"),
    ("responses message without content", "POST", "/v1/responses", {"input": [{"type": "message", "role": "user"}]},
     400, "input.0.content"),
    ("responses message of an unknown role", "POST", "/v1/responses", {"input": [{"role": "wizard", "content": "x"}]},
     400, "input.0.role"),
    ("responses function call without a name", "POST", "/v1/responses",
     {"input": [{"type": "function_call", "call_id": "c", "arguments": "{}"}]}, 400, "input.0.name"),
    ("responses function output without a call id", "POST", "/v1/responses",
     {"input": [{"type": "function_call_output", "output": "1"}]}, 400, "input.0.call_id"),
    ("responses function output without its output", "POST", "/v1/responses",
     {"input": [{"type": "function_call_output", "call_id": "c"}]}, 400, "input.0.output"),
    ("responses function output answering no call", "POST", "/v1/responses",
     {"input": [{"type": "function_call_output", "call_id": "c", "output": "1"}]}, 400, "input"),
]


@pytest.mark.parametrize("name,method,path,body,status,param", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_gets_the_protocols_error_shape(server, name, method, path, body, status, param):
    kwargs = {"content": body} if isinstance(body, bytes) else ({"json": body} if body is not None else {})
    r = httpx.request(method, server.url + path, timeout=60, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()
    if path.startswith(MESSAGES):
        assert err["type"] == "error" and err["error"]["type"] and err["error"]["message"]
    else:
        assert set(err["error"]) == {"message", "type", "param", "code"} and err["error"]["message"]
        if param is not None:
            assert err["error"]["param"] == param, err


def test_tool_results_must_answer_a_call(oai, claude):
    """A tool result that answers no call of the assistant message before it is refused in each protocol's shape,
    through the real clients (as OpenAI and Anthropic refuse it); one that answers a call passes."""
    call = {"id": "call_1", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}
    asked = [*QUESTION, {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(openai.BadRequestError) as err:
        oai.chat.completions.create(model="any", max_tokens=2, messages=[
            *asked, {"role": "tool", "tool_call_id": "call_2", "content": "noon"}])
    assert err.value.body["param"] == "messages" and "'call_2'" in err.value.body["message"]
    answered = oai.chat.completions.create(model="any", max_tokens=2, **GREEDY, messages=[
        *asked, {"role": "tool", "tool_call_id": "call_1", "content": "noon"}])
    assert answered.choices[0].finish_reason == "length"

    result = {"type": "tool_result", "tool_use_id": "toolu_1", "content": "noon"}
    with pytest.raises(anthropic.BadRequestError) as err:
        claude.messages.create(model="any", max_tokens=2, messages=[{"role": "user", "content": [result]}])
    assert err.value.body["error"]["type"] == "invalid_request_error" and "'toolu_1'" in str(err.value.body)
    use = {"type": "tool_use", "id": "toolu_1", "name": "get_time", "input": {}}
    reply = claude.messages.create(model="any", max_tokens=2, extra_body=GREEDY, messages=[
        *QUESTION, {"role": "assistant", "content": [use]}, {"role": "user", "content": [result]}])
    assert reply.stop_reason == "max_tokens"

    with pytest.raises(openai.BadRequestError) as err:
        oai.responses.create(model="any", max_output_tokens=2, input=[
            {"type": "function_call_output", "call_id": "call_1", "output": "noon"}])
    assert err.value.body["param"] == "input"


def test_a_constraint_beyond_the_grammar_engine_is_an_error_not_an_empty_answer(server, oai):
    """A regex llguidance gives up on while decoding (a million repeats: past its lexer's limit) ends the request
    with a 400, or a streamed one with an error event, rather than an empty answer that claims to be complete; a
    request decoding beside it is unharmed."""
    huge = {"structured_outputs": {"regex": "a{1000000}"}}
    ask = dict(model="any", messages=QUESTION, max_tokens=12, **GREEDY)
    alone = oai.chat.completions.create(**ask).choices[0].message.content
    with ThreadPoolExecutor(1) as pool:
        beside = pool.submit(oai.chat.completions.create, **ask)
        with pytest.raises(openai.BadRequestError) as err:
            oai.chat.completions.create(**ask, extra_body=huge)
        assert "constraint" in err.value.body["message"]
        with pytest.raises(openai.APIError, match="constraint"):
            for _ in oai.chat.completions.create(**ask, stream=True, extra_body=huge):
                pass
        assert beside.result().choices[0].message.content == alone
    wait_for(lambda: all_slots_idle(server.url), what="all slots to be freed")


def test_escaped_surrogate_pair_is_one_character(server):
    # The lone-surrogate check must let a valid pair through: JSON escapes of one emoji, U+1F600.
    body = b'{"prompt": "\\ud83d\\ude00", "add_special_tokens": false}'
    r = httpx.post(server.url + "/tokenize", content=body, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["tokens"] == server.context.llm.tokenizer.encode("\U0001F600", add_special=False)


def test_prompt_over_the_context_is_context_length_exceeded(server, oai, claude):
    long_text = "hello " * 2000     # the test model's context is 1024 tokens
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="any", messages=[{"role": "user", "content": long_text}])
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as exc:
        oai.completions.create(model="any", prompt=long_text)
    assert exc.value.code == "context_length_exceeded"
    with pytest.raises(anthropic.BadRequestError) as exc:
        claude.messages.create(model="any", max_tokens=5, messages=[{"role": "user", "content": long_text}])
    assert "context length" in str(exc.value)


def test_api_key(server):
    options = server.context.options
    options.api_key = "sekrit"
    try:
        bad = openai.OpenAI(base_url=server.url + "/v1", api_key="wrong", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            bad.models.list()
        r = httpx.post(server.url + CHAT, json=OK_CHAT)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        r = httpx.post(server.url + MESSAGES, json=OK_MSG)
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        good = openai.OpenAI(base_url=server.url + "/v1", api_key="sekrit", max_retries=0)
        assert good.chat.completions.create(model="m", messages=QUESTION, max_tokens=2).choices
        claude = anthropic.Anthropic(base_url=server.url, api_key="sekrit", max_retries=0)
        assert claude.messages.count_tokens(model="m", messages=QUESTION).input_tokens > 0
        assert httpx.get(server.url + "/health").status_code == 200      # health stays open
        assert httpx.get(server.url + "/v1/health").status_code == 200
        assert httpx.get(server.url + "/ping").status_code == 200
        assert httpx.post(server.url + "/invocations", json=OK_CHAT).status_code == 401
    finally:
        options.api_key = None


def test_cors_preflight_and_version(server):
    """Browsers may call the API (CORS, any origin by default, as vLLM and llama.cpp's server allow): the
    preflight is answered before the key check, and errors carry the header too. /version is open."""
    origin = {"Origin": "http://localhost:3000"}
    options = server.context.options
    options.api_key = "sekrit"
    try:
        pre = httpx.options(server.url + CHAT, headers={**origin, "Access-Control-Request-Method": "POST",
                                                        "Access-Control-Request-Headers": "authorization,content-type"})
        assert pre.status_code == 200
        assert pre.headers["access-control-allow-origin"] in ("*", origin["Origin"])
        assert "authorization" in pre.headers["access-control-allow-headers"].lower()
        denied = httpx.post(server.url + CHAT, json=OK_CHAT, headers=origin)
        assert denied.status_code == 401 and denied.headers["access-control-allow-origin"] in ("*", origin["Origin"])
        ok = httpx.post(server.url + CHAT, json=OK_CHAT, headers={**origin, "Authorization": "Bearer sekrit"})
        assert ok.status_code == 200 and "access-control-allow-origin" in ok.headers
        from cobatch import __version__
        assert httpx.get(server.url + "/version").json() == {"version": __version__}
    finally:
        options.api_key = None


def test_cors_can_be_limited_or_off():
    from cobatch.server.app import create_app
    from cobatch.server.context import ServerOptions
    from fastapi.testclient import TestClient
    llm = load_llm("smollm2")
    preflight = {"Access-Control-Request-Method": "POST"}
    for origins, origin, allowed in ((("https://app.example",), "https://app.example", True),
                                     (("https://app.example",), "https://evil.example", False),
                                     ((), "https://app.example", False)):
        # Without `with`, the app's lifespan (its engine thread) does not start: the preflight needs none, and
        # the module's live server keeps the model's engine to itself.
        client = TestClient(create_app(llm, ServerOptions(allowed_origins=origins)))
        r = client.options("/v1/models", headers={"Origin": origin, **preflight})
        assert (r.headers.get("access-control-allow-origin") == origin) == allowed, (origins, origin)


def test_cors_methods_headers_request_ids_and_flags_as_vllm_gives_them():
    """vLLM's --allowed-methods / --allowed-headers (JSON lists or comma-separated) limit the preflight;
    --enable-request-id-headers echoes a request's X-Request-Id or makes one; the flags reach ServerOptions."""
    from cobatch.cli import build_parser
    from cobatch.server.app import create_app, server_options
    from fastapi.testclient import TestClient
    args = build_parser().parse_args(["serve", "--allowed-origins", '["https://app.example"]', "--allowed-methods",
                                      '["GET", "POST"]', "--allowed-headers", "content-type",
                                      "--enable-request-id-headers", "--generation-config", "vllm"])
    options = server_options(args)
    assert (options.allowed_origins, options.allowed_methods, options.allowed_headers) == (
        ("https://app.example",), ("GET", "POST"), ("content-type",))
    assert options.request_id_headers and not options.checkpoint_defaults
    client = TestClient(create_app(load_llm("smollm2"), options))
    origin = {"Origin": "https://app.example"}
    put = client.options("/v1/models", headers={**origin, "Access-Control-Request-Method": "PUT"})
    post = client.options("/v1/models", headers={**origin, "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "content-type"})
    assert put.status_code == 400 and post.status_code == 200
    auth = client.options("/v1/models", headers={**origin, "Access-Control-Request-Method": "POST",
                                                  "Access-Control-Request-Headers": "x-custom"})
    assert auth.status_code == 400
    mine = client.get("/version", headers={"X-Request-Id": "req-42"})
    assert mine.headers["x-request-id"] == "req-42"
    made = client.get("/version").headers["x-request-id"]
    assert len(made) == 32 and made != client.get("/version").headers["x-request-id"]
    from cobatch.errors import UserError
    with pytest.raises(UserError, match="--allowed-methods"):
        server_options(build_parser().parse_args(["serve", "--allowed-methods", '["GET", 5]']))


def test_body_over_the_limit_is_413(server):
    options = server.context.options
    saved, options.max_body_bytes = options.max_body_bytes, 1000
    try:
        big = {"messages": [{"role": "user", "content": "x" * 5000}]}
        r = httpx.post(server.url + CHAT, json=big)
        assert r.status_code == 413 and r.json()["error"]["message"]
        r = httpx.post(server.url + MESSAGES, json={**OK_MSG, "system": "x" * 5000})
        assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"

        def chunked():       # no Content-Length: the limit holds while reading
            yield b'{"messages": [{"role": "user", "content": "'
            for _ in range(10):
                yield b"y" * 500
            yield b'"}]}'
        r = httpx.post(server.url + CHAT, content=chunked())
        assert r.status_code == 413
    finally:
        options.max_body_bytes = saved


def test_full_queue_is_429_and_stopping_is_503(server, oai):
    worker = server.context.worker
    saved, worker.max_queue = worker.max_queue, 0
    streams = []
    try:
        # Fill every slot with a long stream.
        for _ in range(worker.num_slots):
            streams.append(RawStream(server.url, CHAT, {"messages": QUESTION, "max_tokens": 500,
                                                        "ignore_eos": True, "stream": True}))
        for s in streams:
            s.read_events(2)
        with pytest.raises(openai.RateLimitError) as exc:
            oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=2)
        assert exc.value.response.headers["retry-after"]
        r = httpx.post(server.url + MESSAGES, json=OK_MSG)
        assert r.status_code == 429 and r.json()["error"]["type"] == "rate_limit_error"
    finally:
        worker.max_queue = saved
        for s in streams:
            s.hard_close()
    wait_for(lambda: all_slots_idle(server.url), what="all slots to be freed")

    worker.accepting = False        # what a shutdown signal does first
    try:
        r = httpx.post(server.url + CHAT, json=OK_CHAT)
        assert r.status_code == 503 and r.headers["retry-after"]
        assert httpx.get(server.url + "/health").status_code == 503
    finally:
        worker.accepting = True
    assert oai.chat.completions.create(model="any", messages=QUESTION, max_tokens=2).choices


def test_predicted_output_gives_the_same_answer_and_counts_its_tokens(server, oai):
    """OpenAI's Predicted Outputs: with the answer itself as the prediction, the answer is the same and most of its
    tokens come from accepted prediction drafts; with a prediction that turns wrong after its start, still the
    same answer, and the drafts past that point rejected. The usage says so (completion_tokens_details), through
    the real openai client."""
    ask = dict(model="any", messages=[{"role": "user", "content": "Write a haiku about the sea."}], max_tokens=24,
               **GREEDY)
    plain = oai.chat.completions.create(**ask)
    text = plain.choices[0].message.content
    assert plain.usage.completion_tokens_details.accepted_prediction_tokens == 0
    right = oai.chat.completions.create(**ask, prediction={"type": "content", "content": text})
    assert right.choices[0].message.content == text
    assert right.usage.completion_tokens_details.accepted_prediction_tokens >= plain.usage.completion_tokens // 2
    turns_wrong = [{"type": "text", "text": text[:len(text) // 3]}, {"type": "text", "text": " Zebra quantum" * 8}]
    wrong = oai.chat.completions.create(**ask, prediction={"type": "content", "content": turns_wrong})
    assert wrong.choices[0].message.content == text
    assert wrong.usage.completion_tokens_details.rejected_prediction_tokens > 0
    bad = httpx.post(server.url + "/v1/chat/completions", json={**ask, "prediction": {"type": "content",
                                                                                       "content": [{"type": "image"}]}})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "prediction.content.0", bad.text
