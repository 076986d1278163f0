"""The prefix cache's spill to disk (`serve --kv-disk-cache DIR --kv-disk-gb N`).

A full block evicted from the KV pool is written to DIR as one record (engine/kv_store.py), named by the model
identity and the block's chain hash; a prefix lookup that misses in the pool reads it back. The chain hash
names the whole prefix up to the block's end, so a block is only ever found again by a prompt with the same
tokens before it. Files outlive the process: the next server on the same model file finds them.

A file that fails any check (checksum, model, layout, hash, tokens) is logged, deleted and treated as a miss:
never used. The directory is kept under N GB by deleting the least recently used files (by mtime; a read
touches its file). Reads and writes run on the engine thread, between steps, synchronously.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from pathlib import Path

from cobatch.engine.kv_cache import KVPool
from cobatch.engine.kv_store import (KVFileError, block_bytes, block_nbytes, load_block, new_header, read_record,
                                     write_record)

log = logging.getLogger("cobatch.kv_disk_cache")

SUFFIX = ".kvblock"
STALE_TMP_S = 3600.0


def _older_than(entry: os.DirEntry, seconds: float) -> bool:
    try:
        return time.time() - entry.stat().st_mtime > seconds
    except OSError:
        return False


def _unlink(path: str | Path) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


class DiskPrefixCache:
    def __init__(self, directory: str | Path, max_bytes: int, pool: KVPool, identity: str):
        self.dir = Path(directory)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes, self.pool, self.identity = max_bytes, pool, identity
        self.files: OrderedDict[str, int] = OrderedDict()     # name -> size, least recently used first
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.startswith(".tmp-") and _older_than(entry, STALE_TMP_S):
                _unlink(entry.path)           # a write cut off by a kill (a live one is younger)
            elif entry.name.endswith(SUFFIX) and entry.is_file():
                st = entry.stat()
                found.append((st.st_mtime_ns, entry.name, st.st_size))
        for _, name, size in sorted(found):
            self.files[name] = size
        self.bytes = sum(self.files.values())
        self.writes = self.hits = self.rejected = 0
        self._evict_over_budget()

    def _name(self, block_hash: int) -> str:
        return f"{self.identity[:16]}-{block_hash:016x}{SUFFIX}"

    def save(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> None:
        name = self._name(block_hash)
        if name in self.files:
            return
        if block_nbytes(self.pool) > self.max_bytes:
            return
        header = new_header("block", self.identity, self.pool, list(tokens), 1, hash=block_hash)
        try:
            size = write_record(self.dir / name, header, block_bytes(self.pool, block_id))
        except OSError as exc:            # a full or read-only disk costs the cache entry, never the request
            log.warning("kv disk cache: could not write %s: %s", name, exc)
            return
        self.files[name] = size
        self.bytes += size
        self.writes += 1
        self._evict_over_budget()

    def load_into(self, block_id: int, block_hash: int, tokens: tuple[int, ...]) -> bool:
        name = self._name(block_hash)
        if name not in self.files:
            return False
        path = self.dir / name
        try:
            header, payload = read_record(path, "block", self.identity, self.pool)
            if header.get("hash") != block_hash or tuple(header.get("tokens", ())) != tokens:
                raise KVFileError("its hash or tokens are not the ones its name promises")
            load_block(self.pool, block_id, payload)
        except (OSError, KVFileError) as exc:
            log.warning("kv disk cache: ignoring %s: %s", name, exc)
            self.rejected += 1
            self._drop(name)
            return False
        self.files.move_to_end(name)
        try:
            os.utime(path)                # most recently used, for the next process's eviction order too
        except OSError:
            pass
        self.hits += 1
        return True

    def _drop(self, name: str) -> None:
        self.bytes -= self.files.pop(name, 0)
        _unlink(self.dir / name)

    def _evict_over_budget(self) -> None:
        while self.bytes > self.max_bytes and self.files:
            self._drop(next(iter(self.files)))
