"""llama.cpp's slot persistence: POST /slots/{id}?action=save|restore|erase.

save    {"filename": "a.bin"} -> {"id_slot", "filename", "n_saved", "n_written", "timings": {"save_ms"}}
restore {"filename": "a.bin"} -> {"id_slot", "filename", "n_restored", "n_read", "timings": {"restore_ms"}}
erase                         -> {"id_slot", "n_erased"}

Files live in `serve --slot-save-path DIR` (save and restore are refused without it). A slot's state is its last
request's tokens and their KV blocks while the prefix cache still holds them (engine/slot_state.py); counts are
in tokens, whole KV blocks only. A restored file's blocks become prefix-cache blocks, so the next request that
continues those tokens, in any slot, skips their prefill. The engine thread only touches the pool; the file
is read and written on a worker thread.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from fastapi import APIRouter, Query, Request
from pydantic import BaseModel, ConfigDict
from starlette.concurrency import run_in_threadpool

from cobatch.engine.kv_store import KVFileError
from cobatch.engine.slot_state import erase_slot, export_slot, import_slot, read_slot, write_slot
from cobatch.server.context import ServerContext, get_context
from cobatch.server.engine_thread import EngineWorker
from cobatch.server.errors import ApiError, bad_request
from cobatch.server.openapi import accepts
from cobatch.server.request_body import read_body

router = APIRouter()

# A plain file name in the save directory: no separators, no "..", no leading dot, no control characters.
_FILENAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,254}")


class SlotFileRequest(BaseModel):
    model_config = ConfigDict(extra="ignore")
    filename: str


def _save_dir(ctx: ServerContext) -> Path:
    if not ctx.options.slot_save_path:
        raise bad_request("slot save and restore are disabled: start the server with --slot-save-path DIR",
                          code="slot_save_disabled")
    return Path(ctx.options.slot_save_path)


def _file(ctx: ServerContext, filename: str) -> Path:
    directory = _save_dir(ctx)
    if not _FILENAME.fullmatch(filename) or ".." in filename:
        raise bad_request(f"invalid filename {filename!r}: a plain file name of letters, digits, '.', '_' and '-'",
                          param="filename")
    return directory / filename


def _idle_slot(worker: EngineWorker, id_slot: int):
    """The slot, on the engine thread: a busy one cannot be saved over or restored into."""
    if not 0 <= id_slot < worker.num_slots:
        raise bad_request(f"no slot {id_slot} (slots are 0 to {worker.num_slots - 1})", param="id_slot")
    slot = worker.slots[id_slot]
    if slot.request is not None:
        raise ApiError(409, f"slot {id_slot} is processing a request", code="slot_busy")
    return slot


@router.post("/slots/{id_slot}")
@accepts(SlotFileRequest)
async def slot_action(request: Request, id_slot: int, action: str = Query(..., pattern="^(save|restore|erase)$")):
    ctx = get_context(request)
    worker, engine = ctx.worker, ctx.llm.engine
    if action == "erase":
        def erase():
            slot = _idle_slot(worker, id_slot)
            n = erase_slot(engine.blocks, slot.tokens)
            slot.tokens, slot.last_prompt = [], ()
            return n
        return {"id_slot": id_slot, "n_erased": await worker.run(erase)}

    body = await read_body(request, SlotFileRequest, ctx.options.max_body_bytes)
    path = _file(ctx, body.filename)
    start = time.perf_counter()
    pool, identity = engine.pool, ctx.llm.kv_identity
    if action == "save":
        state = await worker.run(lambda: export_slot(engine.blocks, pool, _idle_slot(worker, id_slot).tokens))
        try:
            n_written = await run_in_threadpool(write_slot, path, state, identity, pool)
        except OSError as exc:
            raise ApiError(500, f"could not write {body.filename}: {exc.strerror or exc}") from None
        return {"id_slot": id_slot, "filename": body.filename, "n_saved": len(state.tokens), "n_written": n_written,
                "timings": {"save_ms": (time.perf_counter() - start) * 1e3}}

    await worker.run(lambda: _idle_slot(worker, id_slot))      # fail fast, before reading the file
    if not path.is_file():
        raise ApiError(404, f"no saved slot file {body.filename!r}", param="filename", code="file_not_found")
    try:
        state = await run_in_threadpool(read_slot, path, identity, pool, engine.blocks.block_size)
        n_read = path.stat().st_size
    except KVFileError as exc:
        raise bad_request(f"cannot restore {body.filename}: {exc}", param="filename") from None

    def restore():
        slot = _idle_slot(worker, id_slot)
        n = import_slot(engine.blocks, pool, state)
        slot.tokens, slot.last_prompt = state.tokens[:n], tuple(state.tokens[:n])   # new requests with it come here
        return n
    n_restored = await worker.run(restore)
    return {"id_slot": id_slot, "filename": body.filename, "n_restored": n_restored, "n_read": n_read,
            "timings": {"restore_ms": (time.perf_counter() - start) * 1e3}}
