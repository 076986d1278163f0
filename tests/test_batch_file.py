"""`cobatch run-batch`: OpenAI's batch file format in, answers out in the input's order, through the server's app."""

from __future__ import annotations

import json

import pytest

from cobatch import cli
from cobatch.engine.sampler import SamplingParams
from cobatch.server import batch_file
from model_fixtures import load_llm
from test_cli import assert_clean_error, run_cli

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
    code = cli.main(["run-batch", "-i", str(tmp_path), "-o", str(tmp_path / "out.jsonl")])
    assert code == 2 and "Is a directory" in capsys.readouterr().err
    (tmp_path / "in.jsonl").write_text("")
    code = cli.main(["run-batch", "-i", str(tmp_path / "in.jsonl"), "-o", str(tmp_path / "no" / "out.jsonl")])
    assert code == 2 and "no such directory" in capsys.readouterr().err


def _echo_app():
    """An app in place of the server's: /v1/completions answers the body it got, or fails on prompt "fail"."""
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    async def complete(request):
        body = await request.json()
        if body.get("prompt") == "fail":
            raise RuntimeError("a bug in a route")
        return JSONResponse({"echo": body})
    return Starlette(routes=[Route("/v1/completions", complete, methods=["POST"])])


def test_each_bad_line_gets_its_own_error_and_the_others_are_answered():
    """A line JSON cannot send (NaN, a lone surrogate), nested past the parser's depth, a custom_id an earlier line
    has, a request the app fails on: each is that line's error or 500, the rest are answered in order."""
    import asyncio
    import io

    def line(custom_id: str, body: str = '{"prompt": "hi"}') -> bytes:
        return b'{"custom_id": "%s", "url": "/v1/completions", "body": %s}' % (custom_id.encode(), body.encode())
    lines = [line("first"), line("nan", '{"temperature": NaN}'), line("surrogate", '{"prompt": "\\ud800"}'),
             b'{"custom_id": "deep", "body": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", line("first"),
             line("fails", '{"prompt": "fail"}'), line("\\udc00"), line("last")]
    out = io.StringIO()
    counts = asyncio.run(batch_file.answer_lines(_echo_app(), iter(lines), out, concurrency=4))
    assert counts == {"requests": 8, "ok": 3, "refused": 1, "invalid": 4, "tokens": 0}
    records = [json.loads(text) for text in out.getvalue().splitlines()]
    assert [r["custom_id"] for r in records] == ["first", "nan", "surrogate", None, "first", "fails", "\udc00", "last"]
    errors = [(r["error"] or {}).get("message", "") for r in records]
    assert "JSON compliant" in errors[1] and "surrogates" in errors[2]
    assert "not JSON" in errors[3] and "not unique" in errors[4]
    assert records[5]["response"]["status_code"] == 500
    assert [r["response"]["body"] for r in records if r["custom_id"] in ("first", "last") and r["response"]] == \
        [{"echo": {"prompt": "hi"}}] * 2
    assert records[6]["response"]["status_code"] == 200 and "\\udc00" in out.getvalue().splitlines()[6]


def test_a_line_that_is_not_utf8_is_its_own_error_and_the_output_appears_whole(tmp_path, capsys):
    """Run-batch's --config file gives its flags (max_tokens: the requests' default); a line of bytes that are not
    UTF-8 is that line's error; the output file appears only when complete, no .partial beside it."""
    source, answers, config = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "batch.yaml"
    latin1 = b'{"custom_id": "bytes", "url": "/v1/completions", "body": {"prompt": "caf\xe9"}}\n'
    source.write_bytes(latin1 + _line("ok", "/v1/completions", {"prompt": "Hi", "temperature": 0}).encode() + b"\n")
    config.write_text("max_tokens: 1\nctx: 256\n")
    assert cli.main(["run-batch", "-i", str(source), "-o", str(answers), "--config", str(config)]) == 0
    assert "1 answered, 0 refused, 1 not requests" in capsys.readouterr().err
    out = [json.loads(line) for line in answers.read_text().splitlines()]
    assert out[0]["custom_id"] is None and "not UTF-8" in out[0]["error"]["message"]
    assert out[1]["response"]["body"]["usage"]["completion_tokens"] == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["batch.yaml", "in.jsonl", "out.jsonl"]


def test_the_input_file_and_an_existing_output_are_never_overwritten_by_a_failed_run(tmp_path, capsys):
    source, answers = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text(_line("q", "/v1/completions", {"prompt": "Hi"}) + "\n")
    answers.write_text("the answers of an earlier run\n")
    (tmp_path / "link.jsonl").symlink_to(source)
    for output, message in ((source, "is the input file"), (tmp_path / "link.jsonl", "is the input file"),
                            (tmp_path, "is a directory")):
        assert cli.main(["run-batch", "-i", str(source), "-o", str(output)]) == 2
        err = capsys.readouterr().err.strip()
        assert err == f"cobatch: error: --output-file {output}: {message}"
    assert cli.main(["run-batch", "-i", str(source), "-o", str(answers), "-m", str(tmp_path / "none.gguf")]) == 2
    assert "not found" in capsys.readouterr().err
    assert source.read_text().startswith('{"custom_id": "q"')
    assert answers.read_text() == "the answers of an earlier run\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["in.jsonl", "link.jsonl", "out.jsonl"]


@pytest.mark.parametrize("flags, message", [(["-pp", "4"], "no pipeline parallelism"),
                                            (["-dp", "2"], "run-batch runs one engine"),
                                            (["--threads", "0"], "--threads must be at least 1")])
def test_serves_flags_are_checked_as_serve_checks_them(tmp_path, capsys, flags, message):
    source = tmp_path / "in.jsonl"
    source.write_text(_line("q", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}) + "\n")
    assert cli.main(["run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("cobatch: error:") and message in err[0], err
    assert [p.name for p in tmp_path.iterdir()] == ["in.jsonl"]


def test_no_slots_is_an_error_not_a_batch_that_never_ends(tmp_path):
    source = tmp_path / "in.jsonl"
    source.write_text(_line("q", "/v1/completions", {"prompt": "Hi", "max_tokens": 1}) + "\n")
    proc = run_cli("run-batch", "-i", str(source), "-o", str(tmp_path / "out.jsonl"), "--parallel", "0", timeout=120)
    assert_clean_error(proc, "--parallel must be at least 1")
