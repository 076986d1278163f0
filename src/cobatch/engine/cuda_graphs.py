"""CUDA graphs for the decode step: one captured forward per padded batch bucket.

In eager mode each Triton launch costs ~16 us of host time, more than a whole 8B decode step's worth of
kernels can afford; replaying a captured graph costs ~1.2 us per kernel. A decode step of B sequences
replays the graph of the smallest bucket >= B. Padded rows have slot -1 (they write no KV) and sequence
length 0 (their attention reads nothing), so they cost almost nothing and harm no one.
All buckets share one memory pool and one set of static input buffers.
"""

from __future__ import annotations

import sys

import torch
from tqdm import tqdm

from cobatch.batch import AttentionMetadata

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)


class DecodeGraphs:
    def __init__(self, model, pool, max_batch: int, max_context: int, quiet: bool = False):
        dev = pool.k[0].device
        self.model, self.pool = model, pool
        self.buckets = [b for b in DEFAULT_BUCKETS if b < max_batch] + [max_batch]
        self.max_batch = max_batch
        self.max_blocks = -(-max_context // pool.block_size)
        self.max_context = self.max_blocks * pool.block_size
        self.inputs = StagedInputs(max_batch, self.max_blocks, dev)
        self.token_ids, self.positions = self.inputs.token_ids, self.inputs.positions
        self.slot_mapping, self.seq_lens = self.inputs.slot_mapping, self.inputs.seq_lens
        self.block_tables = self.inputs.block_tables
        self.query_start = torch.arange(max_batch + 1, dtype=torch.int32, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.mempool = torch.cuda.graph_pool_handle()
        self._capture_all(quiet)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.query_start[:b + 1], self.seq_lens[:b],
                                 self.block_tables[:b], max_query_len=1, max_seq_len=self.max_context)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model.forward(self.token_ids[:b], self.positions[:b], self._meta(b), self.pool.k, self.pool.v)
        return self.model.logits(hidden)

    @torch.inference_mode()
    def _capture_all(self, quiet: bool) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        # Largest first: smaller graphs then reuse the pool's blocks.
        for b in tqdm(sorted(self.buckets, reverse=True), desc="capturing decode graphs", unit="graph",
                      disable=quiet, file=sys.stderr):
            with torch.cuda.stream(stream):
                self._forward(b)            # warm-up: Triton compiles outside the capture
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.mempool, stream=stream):
                self.logits[b] = self._forward(b)
            self.graphs[b] = graph
        torch.cuda.synchronize()

    def bucket_for(self, n: int) -> int | None:
        return next((b for b in self.buckets if b >= n), None)

    def run(self, token_ids: list[int], positions: list[int], slot_mapping: list[int],
            block_tables: list[list[int]], device_token_ids: torch.Tensor | None = None) -> torch.Tensor:
        """One decode step of n <= max_batch sequences (host lists; sequence lengths are positions + 1) ->
        logits [n, vocab] (a view: use it before the next run). device_token_ids: the n input tokens as a
        device tensor (a step planned before the previous one's tokens reached the host); token_ids are
        then placeholders."""
        b = self.bucket_for(len(token_ids))
        self.inputs.stage(token_ids, positions, slot_mapping, block_tables, b)
        if device_token_ids is not None:
            self.token_ids[:len(token_ids)].copy_(device_token_ids)
        self.graphs[b].replay()
        return self.logits[b][:len(token_ids)]


class StagedInputs:
    """The decode graphs' static inputs and their host mirror, a pinned buffer reused every step.

    A step writes its rows into the mirror (and the padding rows of its bucket: slot -1, length 0) and sends
    them in two copies: the per-row vectors, then the used part of the block tables. Building five pinned
    tensors per step, five copies and two fills cost host time the GPU waited for, each step."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device):
        n = self.max_batch = max_batch
        pin = device.type == "cuda"
        # token ids, positions, slots (int64), then sequence lengths (int32): one byte buffer, one copy
        self.vector_bytes = 3 * 8 * n + 4 * n
        self._host = torch.zeros(self.vector_bytes, dtype=torch.uint8, pin_memory=pin)
        self._device = torch.zeros(self.vector_bytes, dtype=torch.uint8, device=device)
        self.token_ids, self.positions, self.slot_mapping, self.seq_lens = self._views(self._device)
        self._host_views = [t.numpy() for t in self._views(self._host)]
        self._host_views[2][:] = -1             # no slot: rows the capture runs write no KV
        self._device.copy_(self._host)
        self._host_tables = torch.zeros(n, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._host_tables_np = self._host_tables.numpy()
        self.block_tables = torch.zeros(n, max_blocks, dtype=torch.int32, device=device)
        self._sent = torch.cuda.Event() if device.type == "cuda" else None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n = self.max_batch
        ids, pos, slots = buf[:24 * n].view(torch.int64).view(3, n)
        return ids, pos, slots, buf[24 * n:].view(torch.int32)

    def stage(self, token_ids: list[int], positions: list[int], slot_mapping: list[int],
              block_tables: list[list[int]], bucket: int) -> None:
        n = len(token_ids)
        if self._sent is not None:
            self._sent.synchronize()    # the previous step's copies have left the mirror (they have by now: the
                                        # step before it was collected, and they queue right behind it)
        ids, pos, slots, lens = self._host_views
        ids[:n], pos[:n], slots[:n] = token_ids, positions, slot_mapping
        lens[:n] = pos[:n] + 1
        ids[n:bucket], pos[n:bucket], slots[n:bucket], lens[n:bucket] = 0, 0, -1, 0
        width = max(len(t) for t in block_tables)
        tables = self._host_tables_np
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table      # entries past a row's length are never read (length bounds it)
        self._device.copy_(self._host, non_blocking=True)
        self.block_tables[:n, :width].copy_(self._host_tables[:n, :width], non_blocking=True)
        if self._sent is not None:
            self._sent.record()
