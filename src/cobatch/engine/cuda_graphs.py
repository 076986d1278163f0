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
        n = max_batch
        self.token_ids = torch.zeros(n, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(n, dtype=torch.int64, device=dev)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=dev)
        self.query_start = torch.arange(n + 1, dtype=torch.int32, device=dev)
        self.seq_lens = torch.zeros(n, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(n, self.max_blocks, dtype=torch.int32, device=dev)
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

    def run(self, token_ids: torch.Tensor, positions: torch.Tensor, slot_mapping: torch.Tensor,
            seq_lens: torch.Tensor, block_tables: torch.Tensor) -> torch.Tensor:
        """Inputs for n <= max_batch sequences (host tensors, pinned) -> logits [n, vocab] (a view: use it
        before the next run)."""
        n = token_ids.shape[0]
        b = self.bucket_for(n)
        self.token_ids[:n].copy_(token_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[n:b].fill_(-1)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:b].zero_()
        width = block_tables.shape[1]
        self.block_tables[:n, :width].copy_(block_tables, non_blocking=True)
        self.graphs[b].replay()
        return self.logits[b][:n]
