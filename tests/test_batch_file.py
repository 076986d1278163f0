"""`cobatch run-batch`: OpenAI's batch file format in, answers out in the input's order, through the server's app."""

from __future__ import annotations

import json

from cobatch import cli
from cobatch.engine.sampler import SamplingParams
from model_fixtures import load_llm

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _line(custom_id: str, url: str, body: dict, **extra) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url, "body": body, **extra})


def test_a_batch_file_is_answered_line_by_line_in_order(tmp_path, capsys):
    """Fifteen lines through two slots and no queue: the answers come back in the input's order (a request of n = 2
    that finds a slot taken gets a 429 from the app, and is tried again until one frees; one of n = 3 never fits,
    and keeps its 429), a chat answer is the one the engine gives the same conversation, and lines that are no
    request, or that the server refuses, say why."""
    lines = [_line("chat", "/v1/chat/completions", {"model": "gpt-4o-mini", "messages": QUESTION, "max_tokens": 10,
                                                      "temperature": 0})]
    lines += [_line(f"c{i}", "/v1/completions", {"prompt": f"Count to {i}:", "max_tokens": 4, "n": 1 + i % 2,
                                                  "temperature": 0.8, "seed": i}) for i in range(8)]
    lines += ["{not json", _line("bad-body", "/v1/chat/completions", {"messages": "hello"}),
              _line("get", "/v1/models", {}, method="GET"),
              _line("streamed", "/v1/chat/completions", {"messages": QUESTION, "stream": True}), ""]
    lines += [_line("embedding", "/v1/embeddings", {"input": "hello"}),
              _line("too-many", "/v1/completions", {"prompt": "Hi", "max_tokens": 2, "n": 3})]
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("\n".join(lines) + "\n")

    assert cli.main(["run-batch", "-i", str(source), "-o", str(answers), "--parallel", "2", "--max-queue", "0",
                     "--ctx", "1024"]) == 0
    summary = capsys.readouterr().err.strip().splitlines()[-1]
    assert "15 requests" in summary and "10 answered, 2 refused, 3 not requests" in summary

    out = [json.loads(line) for line in answers.read_text().splitlines()]
    assert [o["custom_id"] for o in out] == ["chat", *(f"c{i}" for i in range(8)), None, "bad-body", "get",
                                             "streamed", "embedding", "too-many"]
    assert len({o["id"] for o in out}) == len(out) and all(o["id"].startswith("batch_req_") for o in out)
    by_id = {o["custom_id"]: o for o in out if o["custom_id"]}

    chat = by_id["chat"]["response"]
    assert chat["status_code"] == 200 and by_id["chat"]["error"] is None
    llm = load_llm("smollm2")
    want = llm.engine.generate([llm.encode_chat(QUESTION)], SamplingParams(max_tokens=10, temperature=0))[0]
    assert chat["body"]["choices"][0]["message"]["content"] == llm.tokenizer.decode(want, skip_special=True)
    for i in range(8):
        body = by_id[f"c{i}"]["response"]["body"]
        assert len(body["choices"]) == 1 + i % 2 and body["usage"]["completion_tokens"] == 4 * (1 + i % 2)
    assert len(by_id["embedding"]["response"]["body"]["data"][0]["embedding"]) == llm.config.d_model

    assert by_id["too-many"]["response"]["status_code"] == 429
    refused = by_id["bad-body"]
    assert refused["response"]["status_code"] == 400 and refused["response"]["body"]["error"]["param"] == "messages"
    assert out[9]["response"] is None and "not JSON" in out[9]["error"]["message"]
    assert by_id["get"]["response"] is None and "POST" in by_id["get"]["error"]["message"]
    assert by_id["streamed"]["response"] is None and "stream" in by_id["streamed"]["error"]["message"]


def test_a_missing_input_file_is_one_line_and_exit_code_2(tmp_path, capsys):
    code = cli.main(["run-batch", "-i", str(tmp_path / "none.jsonl"), "-o", str(tmp_path / "out.jsonl")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err == f"cobatch: error: --input-file {tmp_path / 'none.jsonl'}: no such file"
    code = cli.main(["run-batch", "-i", str(tmp_path), "-o", str(tmp_path / "no" / "out.jsonl")])
    assert code == 2 and "no such" in capsys.readouterr().err
