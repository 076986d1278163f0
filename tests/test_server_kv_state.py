"""KV state on disk: llama.cpp's slot save/restore/erase, and the prefix cache's spill surviving a restart.

A "restart" here is a fresh engine (a new, empty KV pool) on the same loaded model and the same directory: what a
second server process on the same model file sees, without loading the weights twice.
"""

from __future__ import annotations

import copy
import logging
from contextlib import contextmanager
from types import SimpleNamespace

import httpx
import openai
import pytest
import torch

from cobatch.engine.disk_cache import SUFFIX, DiskPrefixCache
from cobatch.engine.engine import Engine
from cobatch.engine.kv_cache import KVPool, chain_hash
from cobatch.engine.kv_store import block_bytes
from cobatch.engine.runner import ModelRunner
from cobatch.engine.sampler import SamplingParams
from cobatch.engine.slot_state import SlotState, write_slot
from cobatch.server.context import ServerOptions
from model_fixtures import load_llm
from test_server_support import live_server

TEXT = ("The lighthouse keeper wrote in his log every night: the wind, the ships that passed, the colour of the "
        "sea at dusk, and whether the lamp had needed oil. One winter the entries grew short.")
MORE = " In spring he began to write again, longer than before."
BLOCK = 16


@pytest.fixture(scope="module")
def llm():
    return load_llm("smollm2")


def with_fresh_engine(llm, spill_dir=None, num_blocks: int = 96):
    """The same model with an engine of its own: an empty pool, optionally spilling to spill_dir."""
    pool = KVPool(llm.config, num_blocks, BLOCK, llm.engine.pool.dtype, "cpu")
    runner = ModelRunner(llm.model, pool, torch.device("cpu"), llm.tokenizer.stop_ids)
    spill = DiskPrefixCache(spill_dir, 1 << 30, pool, llm.kv_identity) if spill_dir else None
    clone = copy.copy(llm)
    clone.engine = Engine(runner, llm.tokenizer.stop_ids, max_context=1024, max_num_seqs=2, overlap=False,
                          spill=spill)
    return clone


@contextmanager
def client(llm, **options):
    with live_server(llm, ServerOptions(**options)) as srv:
        yield srv, openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def complete(oai, ids: list[int], n: int = 6):
    out = oai.completions.create(model="m", prompt=ids, max_tokens=n, temperature=0, seed=0)
    return out.choices[0].text, out.usage.prompt_tokens_details.cached_tokens


def slot_action(srv, id_slot: int, action: str, body: dict | None = None) -> httpx.Response:
    return httpx.post(f"{srv.url}/slots/{id_slot}", params={"action": action}, json=body or {}, timeout=120)


def whole_blocks(n_tokens: int) -> int:
    """Tokens of a prompt of n_tokens that the prefix cache can serve (whole blocks, never the last token)."""
    return (n_tokens - 1) // BLOCK * BLOCK


# --- slots ----------------------------------------------------------------------------------------

def test_slot_save_erase_restore_round_trip(llm, tmp_path):
    prompt = llm.encode_prompt(TEXT)
    longer = prompt + llm.tokenizer.encode(MORE, add_special=False)
    with client(with_fresh_engine(llm), slot_save_path=str(tmp_path)) as (srv, oai):
        r = httpx.post(srv.url + "/completion", json={"prompt": prompt, "n_predict": 4, "temperature": 0}, timeout=120)
        assert r.status_code == 200, r.text
        id_slot = r.json()["id_slot"]

        saved = slot_action(srv, id_slot, "save", {"filename": "lighthouse.bin"})
        assert saved.status_code == 200, saved.text
        body = saved.json()
        n_saved = body["n_saved"]
        assert n_saved == whole_blocks(len(prompt) + 4) >= 2 * BLOCK
        assert body["id_slot"] == id_slot and body["filename"] == "lighthouse.bin"
        assert body["n_written"] == (tmp_path / "lighthouse.bin").stat().st_size > 0
        assert body["timings"]["save_ms"] >= 0
        assert [p.name for p in tmp_path.iterdir()] == ["lighthouse.bin"]       # no temporary file left

        erased = slot_action(srv, id_slot, "erase")
        assert erased.json() == {"id_slot": id_slot, "n_erased": n_saved}
        uncached_text, cached = complete(oai, longer)
        assert cached == 0                                          # the erase took the prompt's blocks away

        slot_id = srv.context.worker.slots.index(next(s for s in srv.context.worker.slots if s.tokens))
        assert slot_action(srv, slot_id, "erase").json()["n_erased"] >= n_saved
        restored = slot_action(srv, id_slot, "restore", {"filename": "lighthouse.bin"})
        assert restored.status_code == 200, restored.text
        assert restored.json()["n_restored"] == n_saved
        assert restored.json()["n_read"] == body["n_written"]
        text, cached = complete(oai, longer)
        assert cached == n_saved and text == uncached_text


def test_bad_slot_filenames_are_400(llm, tmp_path):
    with client(with_fresh_engine(llm), slot_save_path=str(tmp_path / "slots")) as (srv, _):
        for filename in ["../escape.bin", "a/b.bin", ".hidden", "", "x" * 300, "nul\x00.bin", "..", "back\\slash",
                         "/etc/passwd"]:
            for action in ("save", "restore"):
                r = slot_action(srv, 0, action, {"filename": filename})
                assert r.status_code == 400 and r.json()["error"]["param"] == "filename", (filename, r.text)
    assert not (tmp_path / "escape.bin").exists() and not (tmp_path / "slots").exists()


def test_slot_requests_without_a_save_path_or_with_bad_arguments(llm, tmp_path):
    with client(with_fresh_engine(llm)) as (srv, _):
        r = slot_action(srv, 0, "save", {"filename": "a.bin"})
        assert r.status_code == 400 and r.json()["error"]["code"] == "slot_save_disabled"
        assert "--slot-save-path" in r.json()["error"]["message"]
        assert slot_action(srv, 0, "erase").status_code == 200          # erase needs no directory
    with client(with_fresh_engine(llm), slot_save_path=str(tmp_path)) as (srv, _):
        assert slot_action(srv, 99, "save", {"filename": "a.bin"}).status_code == 400
        assert slot_action(srv, 0, "launch", {"filename": "a.bin"}).status_code == 400
        assert slot_action(srv, 0, "save", {"name": "a.bin"}).status_code == 400
        missing = slot_action(srv, 0, "restore", {"filename": "never-saved.bin"})
        assert missing.status_code == 404 and "never-saved.bin" in missing.json()["error"]["message"]


def test_restoring_a_file_of_another_model_or_a_corrupt_file_is_400(llm, tmp_path):
    pool = llm.engine.pool
    payload = block_bytes(pool, 0)
    write_slot(tmp_path / "other.bin", SlotState(list(range(BLOCK)), payload), "0" * 64, pool)
    write_slot(tmp_path / "torn.bin", SlotState(list(range(BLOCK)), payload), llm.kv_identity, pool)
    data = bytearray((tmp_path / "torn.bin").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (tmp_path / "torn.bin").write_bytes(bytes(data))
    with client(with_fresh_engine(llm), slot_save_path=str(tmp_path)) as (srv, _):
        other = slot_action(srv, 0, "restore", {"filename": "other.bin"})
        assert other.status_code == 400 and "another model" in other.json()["error"]["message"]
        torn = slot_action(srv, 0, "restore", {"filename": "torn.bin"})
        assert torn.status_code == 400 and "checksum" in torn.json()["error"]["message"]
        assert srv.context.llm.engine.blocks.num_used == 0 and not srv.context.llm.engine.blocks.by_hash


# --- the disk prefix cache -----------------------------------------------------------------------

def test_disk_prefix_cache_survives_a_restart(llm, tmp_path):
    prompt = llm.encode_prompt(TEXT)
    with client(with_fresh_engine(llm, tmp_path)) as (_, oai):
        first_text, cached = complete(oai, prompt)
        assert cached == 0
    files = list(tmp_path.glob("*" + SUFFIX))
    assert len(files) >= whole_blocks(len(prompt)) // BLOCK          # written when the server stopped

    with client(with_fresh_engine(llm, tmp_path)) as (srv, oai):
        text, cached = complete(oai, prompt)
        assert cached == whole_blocks(len(prompt)) and text == first_text
        assert srv.context.llm.engine.blocks.spill.hits == cached // BLOCK


def test_a_corrupt_disk_entry_is_ignored_with_a_warning(llm, tmp_path, caplog):
    prompt = llm.encode_prompt(TEXT)
    with client(with_fresh_engine(llm, tmp_path)) as (_, oai):
        first_text, _ = complete(oai, prompt)
    # Corrupt the second block's file: the first is still used, the rest of the chain is not.
    assert whole_blocks(len(prompt)) == 2 * BLOCK
    h = None
    for i in range(2):
        h = chain_hash(h, tuple(prompt[i * BLOCK:(i + 1) * BLOCK]))
    second = tmp_path / f"{llm.kv_identity[:16]}-{h:016x}{SUFFIX}"
    data = bytearray(second.read_bytes())
    data[-100] ^= 0x01
    second.write_bytes(bytes(data))

    with caplog.at_level(logging.WARNING, logger="cobatch.kv_disk_cache"), \
            client(with_fresh_engine(llm, tmp_path)) as (_, oai):
        text, cached = complete(oai, prompt)
    assert cached == BLOCK and text == first_text
    assert any("checksum" in r.getMessage() and second.name in r.getMessage() for r in caplog.records)
    assert second.read_bytes() != bytes(data)     # deleted, then written again from the recomputed block at stop


def test_blocks_evicted_from_the_pool_come_back_from_disk(llm, tmp_path):
    """A pool too small for two prompts: the first one's blocks are evicted (written), then read back."""
    first = llm.encode_prompt(TEXT)
    other = llm.encode_prompt("A completely different text about mountains, rivers and the roads between them. " * 12)
    assert len(first) < 4 * BLOCK and 10 * BLOCK < len(other) < 11 * BLOCK
    engine = with_fresh_engine(llm, tmp_path, num_blocks=12).engine
    params = dict(temperature=0.0, max_tokens=2)
    want = engine.generate([first], SamplingParams(**params))
    engine.generate([other], SamplingParams(**params))
    assert engine.blocks.spill.writes > 0
    rid = engine.add_request(first, SamplingParams(**params))
    got, cached = [], None
    while engine.has_work():
        for out in engine.step():
            if out.request_id == rid and out.new_token is not None:
                got.append(out.new_token)
                cached = out.num_cached_tokens
    assert cached == whole_blocks(len(first)) and [got] == want and engine.blocks.spill.hits > 0


def test_the_disk_cache_stays_under_its_budget_oldest_first(tmp_path):
    cfg = SimpleNamespace(n_layers=2, kv_cache_heads=(1, 4, 4))
    pool = KVPool(cfg, 4, 2, torch.float32, "cpu")
    cache = DiskPrefixCache(tmp_path, 1 << 20, pool, "f" * 64)
    for i in range(3):
        pool.k[0][i].fill_(i + 1)
        cache.save(i, 1000 + i, (i, i))
    size = cache.files[next(iter(cache.files))]
    assert cache.bytes == 3 * size
    tight = DiskPrefixCache(tmp_path, int(2.5 * size), pool, "f" * 64)     # a restart with a smaller budget
    assert list(tight.files) == [cache._name(1001), cache._name(1002)]
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(tight.files)
    assert tight.load_into(3, 1002, (2, 2)) and torch.equal(pool.k[0][3], torch.full_like(pool.k[0][3], 3))
    assert not tight.load_into(3, 1002, (9, 9))             # a hash whose tokens are not the ones stored
    assert not tight.load_into(3, 1000, (0, 0))             # evicted
