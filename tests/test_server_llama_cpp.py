"""llama.cpp server's own routes (/completion, /infill, /props) on the CPU path with Qwen2.5-Coder (it has
fill-in-the-middle and repository-context tokens)."""

from __future__ import annotations

import json
import re

import httpx
import openai
import pytest

from model_fixtures import load_llm
from test_server_support import live_server, together

PROMPT = "def fibonacci(n):"


@pytest.fixture(scope="module")
def server():
    with live_server(load_llm("qwen2.5-coder")) as srv:
        yield srv


def post(server, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=120)


def test_completion_is_the_openai_completion_in_llama_cpp_shape(server):
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = oai.completions.create(model="any", prompt=PROMPT, max_tokens=12, temperature=0)
    r = post(server, "/completion", {"prompt": PROMPT, "n_predict": 12, "temperature": 0, "return_tokens": True})
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["content"] == want.choices[0].text and out["stop"] is True and out["stop_type"] == "limit"
    assert out["tokens_predicted"] == len(out["tokens"]) == 12
    assert out["tokens_evaluated"] == want.usage.prompt_tokens
    assert server.context.llm.tokenizer.decode(out["tokens"]) == out["content"]


def test_logit_bias_in_llama_cpp_forms(server):
    """llama.cpp's logit_bias: [[id, false]] never samples the token, [[text, bias]] biases each of the text's
    tokens, and {"id": bias} works as OpenAI's does."""
    tokenizer = server.context.llm.tokenizer
    base = {"prompt": PROMPT, "n_predict": 6, "temperature": 0, "return_tokens": True}
    plain = post(server, "/completion", base).json()["tokens"]
    first = plain[0]
    banned = post(server, "/completion", {**base, "logit_bias": [[first, False]]}).json()["tokens"]
    assert first not in banned
    word = " banana"
    forced = post(server, "/completion", {**base, "n_predict": 1, "logit_bias": [[word, 100]]}).json()["tokens"]
    assert forced[0] in tokenizer.encode(word, add_special=False)
    as_object = post(server, "/completion", {**base, "n_predict": 1, "logit_bias": {str(first + 1): 100}}).json()
    assert as_object["tokens"] == [first + 1]


def test_stop_word_and_stream(server):
    body = {"prompt": PROMPT, "n_predict": 40, "temperature": 0, "stop": ["return"], "n_probs": 2}
    plain = post(server, "/completion", body).json()
    assert plain["stop_type"] == "word" and plain["stopping_word"] == "return" and "return" not in plain["content"]
    assert len(plain["completion_probabilities"]) == plain["tokens_predicted"]
    first = plain["completion_probabilities"][0]
    assert first["top_logprobs"][0]["logprob"] == pytest.approx(first["logprob"]) and len(first["top_logprobs"]) == 2
    with httpx.stream("POST", server.url + "/completion", json={**body, "stream": True}, timeout=120) as r:
        lines = [line for line in r.iter_lines() if line]
    assert all(line.startswith("data: ") for line in lines) and "[DONE]" not in lines[-1]
    chunks = [json.loads(line[len("data: "):]) for line in lines]
    assert [c["stop"] for c in chunks] == [False] * (len(chunks) - 1) + [True]
    assert "".join(c["content"] for c in chunks) == plain["content"]
    assert chunks[-1]["stop_type"] == "word" and chunks[-1]["tokens_predicted"] == plain["tokens_predicted"]


def test_several_prompts_answer_a_list_or_indexed_streams(server):
    """A /completion of several prompts (texts or id lists), as llama.cpp's server takes it: a list of the answers
    each prompt gets alone, with its index; streamed, each line carries its prompt's index."""
    prompts = [PROMPT, "The capital of France is", "1, 2, 3,"]
    body = {"n_predict": 6, "temperature": 0}
    alone = [post(server, "/completion", {**body, "prompt": p}).json()["content"] for p in prompts]
    together = post(server, "/completion", {**body, "prompt": prompts}).json()
    assert [a["index"] for a in together] == [0, 1, 2] and [a["content"] for a in together] == alone
    ids = post(server, "/tokenize", {"content": prompts[1]}).json()["tokens"]
    as_ids = post(server, "/completion", {**body, "prompt": [ids, ids]}).json()
    assert [a["content"] for a in as_ids] == [alone[1]] * 2
    with httpx.stream("POST", server.url + "/completion", json={**body, "prompt": prompts, "stream": True},
                      timeout=120) as r:
        chunks = [json.loads(line[len("data: "):]) for line in r.iter_lines() if line]
    for i, text in enumerate(alone):
        mine = [c for c in chunks if c["index"] == i]
        assert "".join(c["content"] for c in mine) == text and mine[-1]["stop"]
    assert post(server, "/completion", {**body, "prompt": ["a"] * 65}).status_code == 400
    picked = post(server, "/completion", {**body, "prompt": prompts[1], "response_fields": [
        "content", "timings/predicted_n", "nothing/here"]}).json()
    assert picked == {"content": alone[1], "timings/predicted_n": 6}


def test_infill_builds_the_fim_prompt_and_matches_openai_suffix(server):
    llm = server.context.llm
    pre, suf, mid = llm.tokenizer.fim_ids
    repo, sep = llm.tokenizer.fim_repo_ids
    prefix, suffix = "def add(a, b):\n    ", "\n\nprint(add(1, 2))\n"
    ids = llm.encode_infill(prefix, suffix, [("util.py", "def sub(a, b):\n    return a - b\n")], "return")
    assert ids[0] == repo and ids.count(sep) == 2 and ids.index(pre) < ids.index(suf) < ids.index(mid)
    assert llm.tokenizer.decode(ids[ids.index(mid) + 1:]) == "return"
    assert "util.py\ndef sub(a, b):" in llm.tokenizer.decode(ids[:ids.index(pre)])

    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    want = oai.completions.create(model="any", prompt=prefix, suffix=suffix, max_tokens=10, temperature=0)
    got = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 10,
                                   "temperature": 0}).json()
    assert got["content"] == want.choices[0].text and got["tokens_evaluated"] == want.usage.prompt_tokens
    extra = post(server, "/infill", {"input_prefix": prefix, "input_suffix": suffix, "n_predict": 4, "temperature": 0,
                                     "input_extra": [{"filename": "util.py", "text": "x = 1\n"}]}).json()
    assert extra["tokens_evaluated"] > got["tokens_evaluated"]


def test_grammar_and_props(server):
    out = post(server, "/completion", {"prompt": "The answer is", "n_predict": 8, "temperature": 0,
                                       "grammar": 'root ::= " " ("yes" | "no") "."'}).json()
    assert re.fullmatch(r" (yes|no)\.", out["content"]) and out["stop_type"] == "eos"
    props = httpx.get(server.url + "/props").json()
    assert props["default_generation_settings"]["n_ctx"] == server.context.llm.engine.max_context
    assert props["total_slots"] == server.context.worker.num_slots and "<|im_start|>" in props["chat_template"]
    assert props["default_generation_settings"]["params"]["temperature"] == 0.8     # llama.cpp's own default


def test_typical_and_xtc_samplers(server):
    """llama.cpp's typ_p and XTC on /completion and on the OpenAI routes: XTC at threshold 0 after top-k 2 always
    draws the second likeliest token (what n_probs lists second); typical_p draws reproducibly by seed; /props
    lists the defaults."""
    probs = post(server, "/completion", {"prompt": PROMPT, "n_predict": 1, "temperature": 0, "n_probs": 2}).json()
    second = probs["completion_probabilities"][0]["top_logprobs"][1]["token"]
    xtc = together(*(lambda seed=seed: post(server, "/completion", {
        "prompt": PROMPT, "n_predict": 1, "temperature": 1, "top_k": 2, "xtc_probability": 1, "xtc_threshold": 0,
        "seed": seed}).json() for seed in range(3)))
    assert [got["content"] for got in xtc] == [second] * 3
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    same = [c.choices[0].text for c in together(*[lambda: oai.completions.create(
        model="any", prompt=PROMPT, max_tokens=6, temperature=1.2, seed=3, extra_body={"typical_p": 0.5})] * 2)]
    assert same[0] == same[1]
    params = httpx.get(server.url + "/props").json()["default_generation_settings"]["params"]
    assert (params["typical_p"], params["xtc_probability"], params["xtc_threshold"]) == (1.0, 0.0, 0.1)
    assert params["top_n_sigma"] == -1.0
    narrow = post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 1.5, "seed": 2,
                                          "top_n_sigma": 0.01}).json()["content"]
    assert narrow == post(server, "/completion", {"prompt": PROMPT, "n_predict": 4, "temperature": 0}).json()["content"]
    bad = post(server, "/completion", {"prompt": PROMPT, "typical_p": 0})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "typical_p"
    # dynamic temperature: T' in [0, 2 T] by the step's entropy, drawn reproducibly by seed; refused below 0
    assert (params["dynatemp_range"], params["dynatemp_exponent"]) == (0.0, 1.0)
    hot = {"prompt": PROMPT, "n_predict": 6, "temperature": 1.0, "dynatemp_range": 1.0, "dynatemp_exponent": 0.5,
           "seed": 5}
    assert post(server, "/completion", hot).json()["content"] == post(server, "/completion", hot).json()["content"]
    bad = post(server, "/completion", {"prompt": PROMPT, "dynatemp_range": -1})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "dynatemp_range"
    # repeat_last_n: llama.cpp's window of 64 by default; 0 turns the penalties off
    assert params["repeat_last_n"] == 64
    greedy = {"prompt": "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,", "n_predict": 4, "temperature": 0}
    plain = post(server, "/completion", greedy).json()["content"]
    assert plain.startswith(" 4")
    assert not post(server, "/completion", {**greedy, "repeat_penalty": 3.0}).json()["content"].startswith(" 4")
    assert post(server, "/completion", {**greedy, "repeat_penalty": 3.0, "repeat_last_n": 0}).json()["content"] == plain


def test_dry_breaks_a_repeat(server):
    """DRY on /completion and the OpenAI routes: greedy decoding continues "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3," with
    " 4"; with DRY the tokens that would extend the repeat lose enough that it does not; a comma as a sequence
    breaker cuts every repeat short, so the output is plain greedy again."""
    prompt = "1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3,"
    greedy = {"prompt": prompt, "n_predict": 4, "temperature": 0}
    plain = post(server, "/completion", greedy).json()["content"]
    assert plain.startswith(" 4")
    dry = post(server, "/completion", {**greedy, "dry_multiplier": 10}).json()["content"]
    assert not dry.startswith(" 4") and dry != plain
    broken = post(server, "/completion", {**greedy, "dry_multiplier": 10, "dry_sequence_breakers": [","]}).json()
    assert broken["content"] == plain
    oai = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
    via_openai = oai.completions.create(model="any", prompt=prompt, max_tokens=4, temperature=0,
                                        extra_body={"dry_multiplier": 10}).choices[0].text
    assert via_openai == dry
    params = httpx.get(server.url + "/props").json()["default_generation_settings"]["params"]
    assert (params["dry_multiplier"], params["dry_base"], params["dry_allowed_length"]) == (0.0, 1.75, 2)


def test_mirostat_on_completion(server):
    """Mirostat 2 on /completion (its state from step to step: tests/test_engine.py): the same seed gives the same
    text, other seeds others; /props lists the defaults."""
    body = {"prompt": PROMPT, "n_predict": 8, "temperature": 1.0, "mirostat": 2, "mirostat_tau": 8.0}
    texts = [r.json()["content"] for r in together(*(lambda s=s: post(server, "/completion", {**body, "seed": s})
                                                     for s in (0, 1, 2, 0)))]
    assert texts[0] == texts[3] and len(set(texts)) > 1
    params = httpx.get(server.url + "/props").json()["default_generation_settings"]["params"]
    assert (params["mirostat"], params["mirostat_tau"], params["mirostat_eta"]) == (0, 5.0, 0.1)


def test_serve_sampling_flags_are_the_defaults_of_every_protocol():
    """serve --temperature 0 --top-k 1 ...: a request that leaves those fields unset samples with them (OpenAI,
    llama.cpp's /completion, Anthropic); one that sets them keeps its own."""
    from cobatch.cli import build_parser
    from cobatch.llm import LLM, EngineOptions
    from cobatch.model_files import smollm2_path
    from cobatch.server.app import sampling_defaults
    from cobatch.server.context import ServerOptions
    args = build_parser().parse_args(["serve", "--temp", "0", "--top-k", "1", "--seed", "5", "-n", "3"])
    defaults = sampling_defaults(args)
    assert defaults == {"temperature": 0.0, "top_k": 1, "seed": 5, "max_tokens": 3}
    llm = LLM.load(smollm2_path(), EngineOptions(device="cpu", ctx=256, quiet=True))
    question = [{"role": "user", "content": "Name a colour."}]
    with live_server(llm, ServerOptions(sampling_defaults=defaults)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)
        greedy = oai.chat.completions.create(model="any", messages=question, max_tokens=12, temperature=0)
        unset = together(*[lambda: oai.chat.completions.create(model="any", messages=question, max_tokens=12)] * 2)
        assert [u.choices[0].message.content for u in unset] == [greedy.choices[0].message.content] * 2
        want = oai.completions.create(model="any", prompt=PROMPT, max_tokens=8, temperature=0).choices[0].text
        assert post(srv, "/completion", {"prompt": PROMPT, "n_predict": 8}).json()["content"] == want
        hot = [r.json()["content"] for r in together(*(lambda s=s: post(srv, "/completion", {
            "prompt": PROMPT, "n_predict": 8, "temperature": 1.5, "top_k": 0, "seed": s}) for s in range(4)))]
        assert len(set(hot)) > 1             # the request's own temperature and top_k won
        anthropic_reply = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 12,
                                                                      "messages": question}, timeout=120).json()
        assert anthropic_reply["content"][0]["text"] == greedy.choices[0].message.content
        assert httpx.get(srv.url + "/props").json()["default_generation_settings"]["params"]["temperature"] == 0.0
        # -n: the length of requests that set none
        short = oai.chat.completions.create(model="any", messages=question)
        assert short.usage.completion_tokens == 3 and short.choices[0].finish_reason == "length"
        assert post(srv, "/completion", {"prompt": PROMPT}).json()["tokens_predicted"] == 3


def test_native_embeddings_and_routes_without_v1(server):
    """llama.cpp's /embedding and /embeddings: [{"index", "embedding": [[...]]}] with its normalizations, the same
    vector as /v1/embeddings under each; /chat/completions and /models answer as their /v1 routes do."""
    texts = ["The capital of France is Paris.", "def fibonacci(n):"]
    oai = post(server, "/v1/embeddings", {"input": texts}).json()["data"]
    for path in ("/embedding", "/embeddings"):
        got = post(server, path, {"content": texts}).json()
        assert [item["index"] for item in got] == [0, 1] and all(len(item["embedding"]) == 1 for item in got)
        for item, reference in zip(got, oai):
            assert item["embedding"][0] == pytest.approx(reference["embedding"], abs=1e-6)
    raw = post(server, "/embedding", {"content": texts[0], "embd_normalize": -1}).json()[0]["embedding"][0]
    length = sum(v * v for v in raw) ** 0.5
    assert length > 1.5 and [v / length for v in raw] == pytest.approx(oai[0]["embedding"], abs=1e-6)
    taxicab = post(server, "/embedding", {"input": texts[0], "embd_normalize": 1}).json()[0]["embedding"][0]
    assert sum(abs(v) for v in taxicab) == pytest.approx(1.0, abs=1e-5)
    widest = post(server, "/embedding", {"content": texts[0], "embd_normalize": 0}).json()[0]["embedding"][0]
    assert max(abs(v) for v in widest) == pytest.approx(32760.0, rel=1e-6)
    assert post(server, "/embedding", {"embd_normalize": 2}).status_code == 400
    assert post(server, "/embedding", {"content": [], "embd_normalize": 2}).status_code == 400
    steep = post(server, "/embedding", {"content": texts[0], "embd_normalize": 1000}).json()[0]["embedding"][0]
    assert max(abs(v) for v in steep) == pytest.approx(1.0, rel=1e-2)     # the 1000-norm is about the largest
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 5, "temperature": 0}
    assert post(server, "/chat/completions", chat).json()["choices"] == \
        post(server, "/v1/chat/completions", chat).json()["choices"]
    assert httpx.get(server.url + "/models").json()["data"] == httpx.get(server.url + "/v1/models").json()["data"]


@pytest.mark.parametrize("path,body,param", [
    ("/completion", {"prompt": PROMPT, "n_predict": 0}, "n_predict"),
    ("/completion", {"prompt": PROMPT, "n_predict": -2}, "n_predict"),
    ("/completion", {"prompt": PROMPT, "temperature": -1}, "temperature"),
    ("/completion", {"prompt": ""}, "prompt"),
    ("/completion", {"prompt": [1, 10 ** 9]}, "prompt"),
    ("/completion", {"prompt": PROMPT, "grammar": 'root ::= "a"', "json_schema": {"type": "object"}}, "json_schema"),
    ("/completion", {"prompt": PROMPT, "grammar": "root ::= (("}, "grammar"),
    ("/completion", {"prompt": "hello " * 2000}, "prompt"),
    ("/infill", {"input_prefix": "a", "prompt": [1, 2]}, "prompt"),
    ("/completion", {"prompt": PROMPT, "stop": ["x"] * 17}, "stop"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[5, "high"]]}, "logit_bias.0"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[10 ** 9, 1.0]]}, "logit_bias"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[5]]}, "logit_bias.0"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[1.5, 1.0]]}, "logit_bias.0"),
    ("/completion", {"prompt": PROMPT, "logit_bias": [[True, 1.0]]}, "logit_bias.0"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    r = post(server, path, body)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param
