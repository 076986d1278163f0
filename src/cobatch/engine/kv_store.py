"""The on-disk format of KV state: a model file's identity, and records of KV blocks with a checksum.

Two kinds of record use it: a spilled prefix-cache block (engine/disk_cache.py) and a saved slot
(engine/slot_state.py). A record is

    MAGIC | u32 header length | header (JSON) | payload | blake2b-256 of everything before it

The header names the kind, the model identity and the KV layout (dtype, block shape, layers); the payload is
the blocks' raw bytes, each block its K then its V rows for every layer. A record is written to a temporary
file and renamed into place, so a reader never sees half of one; a torn or tampered file fails the checksum.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
from pathlib import Path

import torch

from cobatch.engine.kv_cache import KVPool

MAGIC = b"COBATCH-KV1\n"
_DIGEST = 32
_SAMPLE = 4 << 20          # bytes hashed at each end of the model file


class KVFileError(Exception):
    """A KV record that cannot be used: corrupt, truncated, of another model, or of another KV layout."""


def model_identity(model_path: str | Path, pool: KVPool, quantization: str = "") -> str:
    """What a KV block depends on: the model file (its size and its first and last 4 MiB, which hold the GGUF
    header, the metadata and tensor data; hashing all of a 16 GB file would take a minute), or each file of a
    checkpoint folder so, the quantization a checkpoint was loaded with, and the KV layout."""
    path = Path(model_path)
    h = hashlib.sha256(b"cobatch-kv-identity-1")
    for file in sorted(p for p in path.iterdir() if p.is_file()) if path.is_dir() else [path]:
        if path.is_dir():
            h.update(file.name.encode() + b"\0")
        size = file.stat().st_size
        h.update(struct.pack("<Q", size))
        with open(file, "rb") as f:
            h.update(f.read(_SAMPLE))
            if size > _SAMPLE:
                f.seek(max(_SAMPLE, size - _SAMPLE))
                h.update(f.read(_SAMPLE))
    if quantization:
        h.update(quantization.encode())
    h.update(json.dumps(layout(pool)).encode())
    return h.hexdigest()


def layout(pool: KVPool) -> dict:
    return {"dtype": str(pool.dtype).removeprefix("torch."), "layers": len(pool.k),
            "block_shape": list(pool.k[0].shape[1:])}


def block_nbytes(pool: KVPool) -> int:
    return (len(pool.k) + len(pool.v)) * pool.k[0][0].numel() * pool.k[0].element_size()


def block_bytes(pool: KVPool, block_id: int) -> bytes:
    """One block's K and V rows of every layer (MLA: its latent rows only), as raw bytes (copied to the host)."""
    rows = torch.stack([k[block_id] for k in pool.k] + [v[block_id] for v in pool.v])
    return rows.contiguous().view(torch.uint8).cpu().numpy().tobytes()


def load_block(pool: KVPool, block_id: int, data: bytes | memoryview) -> None:
    """Write bytes made by block_bytes into a block of the pool."""
    caches = pool.k + pool.v
    raw = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    rows = raw.view(pool.dtype).reshape(len(caches), *pool.k[0].shape[1:]).to(pool.k[0].device)
    for cache, row in zip(caches, rows):
        cache[block_id].copy_(row)


def write_record(path: Path, header: dict, payload: bytes, *, durable: bool = False) -> int:
    """Write a record atomically (temporary file, then rename); returns its size in bytes. durable: fsync it
    first (a saved slot; a cache entry can be lost in a crash, the checksum then rejects what is left)."""
    head = json.dumps(header, separators=(",", ":")).encode()
    body = MAGIC + struct.pack("<I", len(head)) + head + payload
    digest = hashlib.blake2b(body, digest_size=_DIGEST).digest()
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(body)
            f.write(digest)
            if durable:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return len(body) + _DIGEST


def read_record(path: Path, kind: str, identity: str, pool: KVPool) -> tuple[dict, memoryview]:
    """A record's header and payload, after checking its checksum, kind, model identity and KV layout."""
    data = path.read_bytes()
    if len(data) < len(MAGIC) + 4 + _DIGEST or not data.startswith(MAGIC):
        raise KVFileError("not a cobatch KV file")
    body, digest = memoryview(data)[:-_DIGEST], data[-_DIGEST:]
    if hashlib.blake2b(body, digest_size=_DIGEST).digest() != digest:
        raise KVFileError("checksum mismatch (a corrupt or truncated file)")
    (head_len,) = struct.unpack_from("<I", data, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(bytes(body[start:start + head_len]))
    except ValueError:
        raise KVFileError("unreadable header") from None
    if not isinstance(header, dict) or header.get("kind") != kind:
        raise KVFileError(f"not a {kind} record")
    if header.get("model") != identity:
        raise KVFileError("saved by another model file (or another KV cache layout)")
    if header.get("layout") != layout(pool):
        raise KVFileError(f"KV layout {header.get('layout')} differs from this server's {layout(pool)}")
    payload = body[start + head_len:]
    if len(payload) != header.get("n_blocks", -1) * block_nbytes(pool):
        raise KVFileError("payload size does not match the header")
    return header, payload


def new_header(kind: str, identity: str, pool: KVPool, tokens: list[int], n_blocks: int, **fields) -> dict:
    return {"kind": kind, "model": identity, "layout": layout(pool), "tokens": list(tokens), "n_blocks": n_blocks,
            **fields}
