"""LoRA adapters (loader/lora.py, models/lora.py): PEFT folders and llama.cpp GGUF adapters, each row of a step
through its own adapter or none.

The reference is PEFT itself: a random adapter made and saved by PEFT on a transformers model, whose logits with the
adapter are what ours must match. The base models are tiny random checkpoints written by transformers, and a tiny
GGUF llama (whose q and k rows are permuted, so B's must be too) that transformers reads back for PEFT.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os

import pytest
import torch

from cobatch import cli
from cobatch.engine.sampler import SamplingParams
from cobatch.errors import UserError
from cobatch.llm import LLM, EngineOptions, _check_slot_memory
from cobatch.loader.hf import HFCheckpoint
from cobatch.loader.lora import load_adapter
from cobatch.model_files import smollm2_path
from cobatch.models.registry import model_class
from cobatch.testing import hf_checkpoints
from cobatch.testing.gguf_writer import write_random_model
from cobatch.testing.lora_adapters import (ATTENTION, FEED_FORWARD, FUSED, peft_to_gguf, write_peft_adapter,
                                          write_random_adapter)
from conftest import requires_cuda
from model_checks import open_gguf, prompt_logits, transformers_float_model

transformers = pytest.importorskip("transformers")
pytest.importorskip("peft")
# the server's tests need its packages and the clients (the GPU machine's image has neither: its run skips them)
needs_server = pytest.mark.skipif(any(importlib.util.find_spec(m) is None for m in ("fastapi", "openai", "anthropic")),
                                  reason="the server's packages (fastapi) and the openai / anthropic clients")

IDS = [(i * 37 + 5) % 360 for i in range(24)]
FAMILIES = ["llama", "qwen2", "phi3", "gemma2"]
# float32 both ways, the same weights; the adapters move the logits by about 5 (measured: under 3e-5 apart)
BOUND = 1e-4


def _peft_logits(peft_model, ids) -> tuple[torch.Tensor, torch.Tensor]:
    """(logits with the adapter, logits without), float32."""
    with torch.inference_mode():
        with_adapter = peft_model(torch.tensor([ids])).logits[0].float()
        with peft_model.disable_adapter():
            base = peft_model(torch.tensor([ids])).logits[0].float()
    return with_adapter, base


@pytest.fixture(scope="module")
def adapted(tmp_path_factory):
    """family -> (base folder, adapter folder, PEFT's logits with the adapter, without)."""
    root = tmp_path_factory.mktemp("lora")
    out = {}
    for i, family in enumerate(FAMILIES):
        folder = hf_checkpoints.write_tiny_model(root / family, family, seed=40 + i)
        model = transformers_float_model(folder)
        targets = FUSED if family == "phi3" else ATTENTION + FEED_FORWARD
        peft_model, adapter = write_peft_adapter(model, root / f"{family}-adapter", targets, seed=50 + i)
        out[family] = (folder, adapter, *_peft_logits(peft_model, IDS))
    return out


def _logits(model, cfg, slot: int, ids=IDS) -> torch.Tensor:
    model.lora.stage(torch.full((len(ids),), slot, dtype=torch.int64))
    return prompt_logits(model, cfg, ids)


@pytest.mark.parametrize("family", FAMILIES)
def test_peft_adapter_matches_peft(adapted, family):
    """Every projection adapted (phi3's fused ones as PEFT targets them); slot 0 is the base model, bit for bit."""
    folder, adapter, ref, ref_base = adapted[family]
    ckpt = HFCheckpoint(folder, "none")
    cfg = ckpt.config
    model = model_class(cfg)(cfg, ckpt, max_positions=64, adapters=[load_adapter(adapter, cfg)], adapter_rows=64)
    ours = _logits(model, cfg, 1)
    assert (ours - ref).abs().max() < BOUND and torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ref - ref_base).abs().max() > 1.0          # the adapter changes what the model says
    plain = model_class(cfg)(cfg, ckpt, max_positions=64)
    assert torch.equal(_logits(model, cfg, 0), prompt_logits(plain, cfg, IDS))
    assert (prompt_logits(plain, cfg, IDS) - ref_base).abs().max() < BOUND


@pytest.fixture(scope="module")
def gguf_llama(tmp_path_factory):
    """A tiny GGUF llama (q and k rows permuted), transformers' reading of it with a PEFT adapter, and the adapter
    as a PEFT folder and as llama.cpp's GGUF: (model path, PEFT folder, GGUF adapter, PEFT's logits, without)."""
    root = tmp_path_factory.mktemp("lora-gguf")
    tokenizer = os.environ.get("COBATCH_CUT_MODEL") or smollm2_path()     # (the GPU machine has no SmolLM2 package)
    path = write_random_model(root / "tiny.gguf", "tiny", "q8_0", tokenizer_from=tokenizer, seed=61)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(root), gguf_file=path.name,
                                                              dtype=torch.float32).eval()
    peft_model, folder = write_peft_adapter(model, root / "adapter", ATTENTION + FEED_FORWARD, seed=62, alpha=16)
    _, cfg = open_gguf(path)
    gguf_adapter = peft_to_gguf(folder, root / "adapter.gguf", "llama", cfg.n_heads, cfg.n_kv_heads)
    return (path, folder, gguf_adapter, *_peft_logits(peft_model, IDS))


@pytest.mark.parametrize("form", ["peft", "gguf"])
def test_adapter_on_a_gguf_llama_matches_peft(gguf_llama, form):
    """PEFT's B rows of q and k are permuted to the file's rotation order; llama.cpp's GGUF adapter has them so."""
    path, folder, gguf_adapter, ref, ref_base = gguf_llama
    f, cfg = open_gguf(path)
    adapter = load_adapter(folder if form == "peft" else gguf_adapter, cfg)
    assert {part for _, part in adapter.pairs} == {"q", "k", "v", "o", "gate", "up", "down"}
    model = model_class(cfg)(cfg, f, max_positions=64, adapters=[adapter], adapter_rows=64)
    ours = _logits(model, cfg, 1)
    assert (ours - ref).abs().max() < BOUND and torch.equal(ours.argmax(-1), ref.argmax(-1))
    assert (ref - ref_base).abs().max() > 1.0


@pytest.fixture(scope="module")
def served(adapted, tmp_path_factory):
    """An engine on the tiny llama with two adapters: PEFT's, and the same at half strength."""
    folder, adapter, _, _ = adapted["llama"]
    return LLM.load(folder, EngineOptions(device="cpu", quantization="none", ctx=256, max_num_seqs=4, quiet=True,
                                          lora_modules=(("a", str(adapter), 1.0), ("half", str(adapter), 0.5))))


def test_rows_of_different_adapters_in_one_step_decode_as_alone(served):
    """Base, a and half batched: each greedy output equals its own run alone, and the three differ."""
    engine = served.engine
    prompt = IDS[:20]
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=name)
              for name in (None, "a", "half")]
    together = engine.generate([prompt] * 3, params)
    alone = [engine.generate([prompt], [p])[0] for p in params]
    assert together == alone
    assert len({tuple(t) for t in together}) == 3


def test_prefix_cache_keeps_each_adapters_blocks_apart(served):
    """The same prompt under the base model, then an adapter: the adapter's request finds none of the base's KV
    blocks; the adapter's second request finds its own."""
    engine = served.engine
    prompt = [(i * 13 + 7) % 300 for i in range(50)]        # three full blocks of 16
    cached = []
    for name in (None, "a", "a", "half"):
        seq = engine.seqs[engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=1, adapter=name))]
        while engine.has_work():
            engine.step()
        cached.append(seq.num_cached_prompt)
    assert cached == [0, 0, 48, 0]


def test_unknown_adapter_is_a_user_error(served):
    with pytest.raises(UserError, match="no LoRA adapter named 'b'"):
        served.engine.add_request(IDS, SamplingParams(adapter="b"))


def _edit(folder, tmp_path, **changes):
    import shutil
    copy = tmp_path / "edited"
    shutil.copytree(folder, copy)
    config = json.loads((copy / "adapter_config.json").read_text())
    (copy / "adapter_config.json").write_text(json.dumps({**config, **changes}))
    return copy


@pytest.mark.parametrize("change, message", [
    ({"use_dora": True}, "use_dora"),
    ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    ({"peft_type": "IA3"}, "peft_type 'IA3'"),
])
def test_adapters_it_cannot_apply_are_refused(adapted, tmp_path, change, message):
    folder, adapter, _, _ = adapted["llama"]
    cfg = HFCheckpoint(folder, "none").config
    with pytest.raises(UserError, match=message):
        load_adapter(_edit(adapter, tmp_path, **change), cfg)


def test_adapter_of_another_model_is_refused(adapted, gguf_llama):
    """An adapter for other widths or fewer layers, and a GGUF adapter for another arch."""
    folder, adapter, _, _ = adapted["llama"]
    cfg = HFCheckpoint(folder, "none").config
    with pytest.raises(UserError, match=r"layer 0's \w+ is \d+ x \d+; the model's is \d+ x \d+"):
        load_adapter(adapter, dataclasses.replace(cfg, ffn_dim=2 * cfg.ffn_dim))
    with pytest.raises(UserError, match="the model has 1 layers"):
        load_adapter(adapter, dataclasses.replace(cfg, n_layers=1))
    _, _, gguf_adapter, _, _ = gguf_llama
    qwen = HFCheckpoint(adapted["qwen2"][0], "none").config
    with pytest.raises(UserError, match="is for llama models; the model is qwen2"):
        load_adapter(gguf_adapter, qwen)


def test_cli_bad_adapter_is_one_line_and_exit_code_2(adapted, tmp_path, capsys):
    folder, _, _, _ = adapted["llama"]
    code = cli.main(["generate", "-p", "hi", "-m", str(folder), "--quantization", "none", "--device", "cpu",
                     "--lora", str(tmp_path / "missing")])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "LoRA adapter not found" in err[0]


def test_cli_generates_through_the_adapter(adapted, capsys):
    folder, adapter, _, _ = adapted["llama"]
    texts = []
    for extra in ([], ["--lora", str(adapter)]):
        code = cli.main(["generate", "-p", "Hello", "-m", str(folder), "--quantization", "none", "--device", "cpu",
                         "--temperature", "0", "-n", "8", *extra])
        texts.append(capsys.readouterr().out)
        assert code == 0
    assert texts[0] != texts[1]


@needs_server
def test_server_serves_each_adapter_as_a_model(served):
    """vLLM's way: /v1/models lists the adapters beside the model, and a request names one as its `model`; the real
    openai and anthropic clients."""
    import anthropic
    import openai
    from cobatch.server.context import ServerOptions
    from test_server_support import live_server
    with live_server(served, ServerOptions(model_name="tiny", accept_any_model=False)) as srv:
        oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=60)
        cards = {m.id: m for m in oai.models.list().data}
        assert list(cards) == ["tiny", "a", "half"]
        assert cards["a"].model_extra["parent"] == "tiny" and cards["a"].model_extra["root"].endswith("adapter")
        answers = {}
        for name in ("tiny", "a", "half"):
            reply = oai.chat.completions.create(model=name, messages=[{"role": "user", "content": "Hi"}],
                                                max_tokens=6, temperature=0)
            assert reply.model == name
            answers[name] = reply.choices[0].message.content
        assert len(set(answers.values())) == 3
        claude = anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0)
        message = claude.messages.create(model="a", max_tokens=6, extra_body={"temperature": 0},
                                         messages=[{"role": "user", "content": "Hi"}])
        assert message.model == "a" and message.content[0].text == answers["a"]
        with pytest.raises(openai.NotFoundError):
            oai.chat.completions.create(model="b", messages=[{"role": "user", "content": "Hi"}], max_tokens=2)


@requires_cuda
def test_gpu_adapters_match_the_cpu_and_decode_graphs_run_them(adapted):
    """On CUDA (q8_0 on load, float16): logits with the adapter close to the CPU path's on the same q8_0 weights; a
    decode graph's steps with base, a and half rows batched give what each gives alone."""
    folder, adapter, _, _ = adapted["llama"]
    logits = {}
    for device, dtype in (("cpu", torch.float32), ("cuda", torch.float16)):
        ckpt = HFCheckpoint(folder, "q8_0", device)
        cfg = ckpt.config
        model = model_class(cfg)(cfg, ckpt, device, dtype, max_positions=64, adapters=[load_adapter(adapter, cfg)],
                                 adapter_rows=64)
        logits[device] = [_logits(model, cfg, slot) for slot in (0, 1)]
    for cpu, gpu in zip(logits["cpu"], logits["cuda"]):
        assert ((gpu - cpu).norm() / cpu.norm()).item() < 2e-2
    llm = LLM.load(folder, EngineOptions(device="cuda", ctx=256, max_num_seqs=4, quiet=True,
                                         lora_modules=(("a", str(adapter), 1.0), ("half", str(adapter), 0.5))))
    assert llm.engine.runner.graphs is not None
    params = [SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, adapter=name)
              for name in (None, "a", "half")]
    together = llm.engine.generate([IDS[:20]] * 3, params)
    assert together == [llm.engine.generate([IDS[:20]], [p])[0] for p in params]
    assert len({tuple(t) for t in together}) == 3


def test_adapters_loaded_and_unloaded_at_run_time_match_peft(adapted):
    """Slots sized at start (2 of rank 8, every projection), filled and emptied later: the logits through a loaded
    adapter are PEFT's, and once it is unloaded the base model's again, bit for bit."""
    folder, adapter, ref, _ = adapted["llama"]
    ckpt = HFCheckpoint(folder, "none")
    cfg = ckpt.config
    model = model_class(cfg)(cfg, ckpt, max_positions=64, adapter_rows=64, adapter_slots=2, adapter_rank=8,
                             runtime_adapters=True)
    base = _logits(model, cfg, 0)
    assert torch.equal(base, prompt_logits(model_class(cfg)(cfg, ckpt, max_positions=64), cfg, IDS))
    model.lora.load(load_adapter(adapter, cfg, "first"))
    slot = model.lora.load(load_adapter(adapter, cfg, "second", scale=0.5))
    assert slot == 2
    ours = _logits(model, cfg, 1)
    assert (ours - ref).abs().max() < BOUND and torch.equal(ours.argmax(-1), ref.argmax(-1))
    with pytest.raises(UserError, match="all 2 slots hold adapters"):
        model.lora.load(load_adapter(adapter, cfg, "third"))
    with pytest.raises(UserError, match="already loaded"):
        model.lora.load(load_adapter(adapter, cfg, "second"))
    model.lora.unload("first")
    assert torch.equal(_logits(model, cfg, 1), base)
    assert model.lora.load(load_adapter(adapter, cfg, "third")) == 1


def test_an_adapter_in_use_is_not_unloaded(adapted):
    folder, adapter, _, _ = adapted["llama"]
    llm = LLM.load(folder, EngineOptions(device="cpu", quantization="none", ctx=128, max_num_seqs=2, quiet=True,
                                         runtime_lora=True, max_lora_rank=4))
    llm.engine.load_adapter(load_adapter(adapter, llm.config, "a"))
    llm.engine.add_request(IDS, SamplingParams(temperature=0, max_tokens=2, adapter="a"))
    with pytest.raises(UserError, match="in use by 1 request"):
        llm.engine.unload_adapter("a")
    while llm.engine.has_work():
        llm.engine.step()
    llm.engine.unload_adapter("a")
    with pytest.raises(UserError, match="no LoRA adapter named 'a'"):
        llm.engine.add_request(IDS, SamplingParams(adapter="a"))


@needs_server
def test_server_loads_and_unloads_adapters_at_run_time(adapted, served):
    """vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter, and llama.cpp's /lora-adapters; refused (400) on a
    server that did not allow them."""
    import httpx
    from cobatch.server.context import ServerOptions
    from test_server_support import live_server
    folder, adapter, _, _ = adapted["llama"]
    llm = LLM.load(folder, EngineOptions(device="cpu", quantization="none", ctx=128, max_num_seqs=2, quiet=True,
                                         runtime_lora=True, max_lora_rank=4))
    chat = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    with live_server(llm, ServerOptions(model_name="tiny", accept_any_model=False)) as srv, \
            httpx.Client(base_url=srv.url, timeout=60) as http:
        loaded = http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": str(adapter)})
        assert loaded.status_code == 200 and "'a' added" in loaded.text
        assert [m["id"] for m in http.get("/v1/models").json()["data"]] == ["tiny", "a"]
        assert http.get("/lora-adapters").json() == [{"id": 0, "name": "a", "path": str(adapter), "scale": 1.0}]
        answers = {name: http.post("/v1/chat/completions", json={**chat, "model": name}).json()
                   for name in ("tiny", "a")}
        assert answers["a"]["model"] == "a"
        assert answers["a"]["choices"][0]["message"] != answers["tiny"]["choices"][0]["message"]
        again = http.post("/v1/load_lora_adapter", json={"lora_name": "b", "lora_path": str(adapter)})
        assert again.status_code == 400 and "all 1 slots" in again.json()["error"]["message"]
        missing = http.post("/v1/load_lora_adapter", json={"lora_name": "c", "lora_path": "/nonexistent"})
        assert missing.status_code == 400 and missing.json()["error"]["param"] == "lora_path"
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 200
        assert http.post("/v1/chat/completions", json={**chat, "model": "a"}).status_code == 404
        assert http.post("/v1/unload_lora_adapter", json={"lora_name": "a"}).status_code == 400
    with live_server(served) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        off = http.post("/v1/load_lora_adapter", json={"lora_name": "x", "lora_path": str(adapter)})
        assert off.status_code == 400 and off.json()["error"]["code"] == "runtime_lora_updating_disabled"


def test_random_adapter_of_a_models_shape_loads_and_adapts(adapted, tmp_path):
    """The benchmarks' adapters (written without PEFT, for real shapes): every projection, the given rank, and a
    small change to the logits."""
    folder, _, _, _ = adapted["llama"]
    ckpt = HFCheckpoint(folder, "none")
    cfg = ckpt.config
    adapter = load_adapter(write_random_adapter(tmp_path / "random", cfg, rank=8, seed=1), cfg)
    assert adapter.rank == 8 and len(adapter.pairs) == 7 * cfg.n_layers
    model = model_class(cfg)(cfg, ckpt, max_positions=64, adapters=[adapter], adapter_rows=64)
    change = (_logits(model, cfg, 1) - _logits(model, cfg, 0)).abs().max()
    assert 1e-4 < change < 1.0


@needs_server
def test_metrics_name_the_adapters_in_use(served):
    """vLLM's lora_requests_info (and ours): the adapters of the requests holding slots and of those waiting."""
    import asyncio
    import httpx
    from cobatch.server.context import ServerOptions
    from cobatch.server.engine_thread import EngineWorker, RequestHandle
    from cobatch.server.metrics import lora_requests_info
    from test_server_support import live_server
    with live_server(served, ServerOptions(metrics_compat="vllm")) as srv, httpx.Client(base_url=srv.url) as http:
        idle = http.get("/metrics").text
    assert 'vllm:lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.0' in idle
    assert 'cobatch_lora_requests_info{max_lora="2",running_lora_adapters="",waiting_lora_adapters=""} 1.0' in idle
    worker, loop = EngineWorker(served.engine), asyncio.new_event_loop()      # (not started: nothing moves them)
    handles = [RequestHandle(f"r{i}", IDS, SamplingParams(adapter=name), loop)
               for i, name in enumerate(("half", None, "a", "half"))]
    worker._active.update({h.id: h for h in handles[:2]})                  # two holding slots, two queued
    worker._queued.extend(handles[2:])
    assert worker.adapters_in_use() == (["half"], ["a", "half"])
    [sample] = lora_requests_info("vllm:lora_requests_info", worker, 2).samples
    assert sample.labels == {"running_lora_adapters": "half", "waiting_lora_adapters": "a,half", "max_lora": "2"}
    loop.close()


def _edited_tensors(adapter, tmp_path, edit):
    """A copy of a PEFT adapter folder with edit(tensors) applied to its safetensors."""
    import shutil
    from safetensors.torch import load_file, save_file
    copy = tmp_path / "edited-tensors"
    shutil.copytree(adapter, copy)
    tensors = load_file(copy / "adapter_model.safetensors")
    edit(tensors)
    save_file(tensors, str(copy / "adapter_model.safetensors"))
    return copy


def _first(tensors, kind, module="q_proj"):
    return next(k for k in tensors if f"{module}.lora_{kind}" in k)


@pytest.mark.parametrize("edit, message", [
    (lambda t: t[_first(t, "A")].view(-1)[0].fill_(float("nan")), "not finite numbers"),
    (lambda t: t[_first(t, "B", "v_proj")].view(-1)[3].fill_(float("inf")), "not finite numbers"),
    (lambda t: t[_first(t, "A")].view(-1)[0].fill_(1e6), "past"),
    (lambda t: t.update({_first(t, "B"): t[_first(t, "B")][:-2]}), "the model's is"),
    (lambda t: t.update({_first(t, "A"): t[_first(t, "A")][:0], _first(t, "B"): t[_first(t, "B")][:, :0]}),
     "not a low-rank pair"),
])
def test_adapter_tensors_that_would_harm_every_row_are_refused(gguf_llama, tmp_path, edit, message):
    """On the GGUF llama (B's q rows permuted after the checks): a NaN, an infinity or a huge value would reach
    every row of a step through the zero multiplying other adapters' columns; wrong rows and rank 0 are refused
    before any arithmetic on them."""
    path, folder, _, _, _ = gguf_llama
    _, cfg = open_gguf(path)
    with pytest.raises(UserError, match=message):
        load_adapter(_edited_tensors(folder, tmp_path, edit), cfg)


@pytest.mark.parametrize("change, message", [({"lora_alpha": "x"}, "not a number"), ({"lora_alpha": None},
                                                                                       "not a number")])
def test_adapter_configs_of_the_wrong_types_are_refused(adapted, tmp_path, change, message):
    folder, adapter, _, _ = adapted["llama"]
    with pytest.raises(UserError, match=message):
        load_adapter(_edit(adapter, tmp_path, **change), HFCheckpoint(folder, "none").config)
    (tmp_path / "edited" / "adapter_config.json").write_text("[1, 2]")
    with pytest.raises(UserError, match="not PEFT's"):
        load_adapter(tmp_path / "edited", HFCheckpoint(folder, "none").config)


def test_slots_scales_and_names_out_of_bounds_are_refused(adapted):
    folder, adapter, _, _ = adapted["llama"]
    cfg = HFCheckpoint(folder, "none").config
    with pytest.raises(UserError, match="scale must be between -100 and 100"):
        load_adapter(adapter, cfg, scale=1e39)
    base = dict(device="cpu", quantization="none", ctx=64, quiet=True)
    two = (("a", str(adapter), 1.0), ("b", str(adapter), 1.0))
    for options, message in ((dict(lora_modules=two, max_loras=1), "fewer slots than the 2 adapters"),
                             (dict(lora_modules=two[:1], max_lora_rank=2), "rank 4, over --max-lora-rank 2"),
                             (dict(runtime_lora=True, max_loras=257), "between 1 and 256")):
        with pytest.raises(UserError, match=message):
            LLM.load(folder, EngineOptions(**base, **options))
    llama_8b = dataclasses.replace(cfg, n_layers=32, d_model=4096, n_heads=32, n_kv_heads=8, head_dim=128,
                                   ffn_dim=14336)
    with pytest.raises(UserError, match=r"slots \(256 of rank 512\) need up to 1920\.0 GiB"):
        _check_slot_memory(llama_8b, 256, 512, True, torch.device("cpu"))


@needs_server
def test_an_adapter_named_as_the_model_is_refused(served):
    from cobatch.server.app import create_app
    from cobatch.server.context import ServerOptions
    with pytest.raises(UserError, match="takes a name the model is served under"):
        create_app(served, ServerOptions(model_name="half"))


@needs_server
def test_llama_cpp_completion_applies_an_adapter_by_its_id(served):
    """llama.cpp's /completion `lora` field: the adapter of the id /lora-adapters gives, at its own scale, runs as a
    request naming it would; other scales, or several adapters at once, are a 400 (never silently the base model)."""
    import httpx
    from test_server_support import live_server
    body = {"prompt": "Hello", "n_predict": 6, "temperature": 0}
    with live_server(served) as srv, httpx.Client(base_url=srv.url, timeout=60) as http:
        ids = {a["name"]: a["id"] for a in http.get("/lora-adapters").json()}
        assert ids == {"a": 0, "half": 1}
        through = http.post("/completion", json={**body, "lora": [{"id": ids["half"], "scale": 0.5}]}).json()
        named = http.post("/v1/completions", json={"model": "half", "prompt": "Hello", "max_tokens": 6,
                                                   "temperature": 0}).json()
        base = http.post("/completion", json={**body, "lora": [{"id": ids["a"], "scale": 0}]}).json()
        assert through["content"] == named["choices"][0]["text"] != base["content"]
        for lora in ([{"id": 0, "scale": 0.7}], [{"id": 0, "scale": 1.0}, {"id": 1, "scale": 0.5}],
                     [{"id": 5, "scale": 1.0}]):
            refused = http.post("/completion", json={**body, "lora": lora})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "lora"
