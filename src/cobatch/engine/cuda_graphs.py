"""CUDA graphs for the engine's steps: one captured forward per padded bucket.

In eager mode each Triton launch costs ~16 us of host time, more than a whole 8B decode step's worth of
kernels can afford; replaying a captured graph costs ~1.2 us per kernel. A decode step of B sequences
replays the graph of the smallest bucket >= B (DecodeGraphs). A step with prefill chunks, alone or beside
decode rows, replays the graph of the smallest (rows, sequences) bucket of STEP_ROWS x STEP_SEQS that holds it
(StepGraphs; COBATCH_STEP_GRAPHS=0 runs them eagerly): eagerly, a 128-token prefill of Llama-3-8B took 25 ms of
launches for 6 ms of GPU work.
Its prefill attention runs over a work list of the step's (sequence, query tile) pairs, so the bucket's
padding sequences cost no programs. Padded rows have slot -1 (they write no KV) and belong to no sequence;
padded sequences have length 0 and no rows (their attention reads nothing), so they harm no one.
The graphs share one memory pool; each kind has one set of static input buffers.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Hashable

import torch
from tqdm import tqdm

from cobatch.batch import AttentionMetadata
from cobatch.kernels.attention import prefill_work, prefill_work_items

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 160, 192, 224, 256)
# StepGraphs' buckets: rows (tokens) in the step, and sequences (a prefill chunk or a decode row each). A chunk
# of --prefill-chunk rows beside the decode rows of every other session is a step of up to chunk + sessions rows.
STEP_ROWS = (16, 32, 64, 128, 256, 512, 768, 1024)
STEP_SEQS = (1, 4, 16, 64, 256)


@torch.inference_mode()
def capture(keys: list[Hashable], forward: Callable[[Hashable], torch.Tensor], mempool, desc: str,
            quiet: bool) -> tuple[dict, dict]:
    """A graph of forward(key) for each key, largest first (smaller graphs then reuse the pool's blocks), each
    run once eagerly before its capture (Triton compiles outside it): ({key: graph}, {key: its output})."""
    graphs, outputs = {}, {}
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    for key in tqdm(sorted(keys, reverse=True), desc=desc, unit="graph", disable=quiet, file=sys.stderr):
        with torch.cuda.stream(stream):
            forward(key)
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=mempool, stream=stream):
            outputs[key] = forward(key)
        graphs[key] = graph
    torch.cuda.synchronize()
    return graphs, outputs


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
        self.mempool = torch.cuda.graph_pool_handle()
        self._capture_all(quiet)

    def _meta(self, b: int) -> AttentionMetadata:
        return AttentionMetadata(self.slot_mapping[:b], self.query_start[:b + 1], self.seq_lens[:b],
                                 self.block_tables[:b], max_query_len=1, max_seq_len=self.max_context)

    def _forward(self, b: int) -> torch.Tensor:
        hidden = self.model.forward(self.token_ids[:b], self.positions[:b], self._meta(b), self.pool.k, self.pool.v)
        return self.model.logits(hidden)

    def _capture_all(self, quiet: bool) -> None:
        self.graphs, self.logits = capture(self.buckets, self._forward, self.mempool, "capturing decode graphs", quiet)

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


def _up_to(sizes: tuple[int, ...], most: int) -> list[int]:
    """The sizes below `most`, and the first that holds it (all of them if none does)."""
    return [b for b in sizes if b < most] + [b for b in sizes if b >= most][:1]


class StagedInputs:
    """The graphs' static inputs and their host mirror, a pinned buffer reused every step.

    A step writes its rows into the mirror (and the padding rows of its bucket: slot -1, length 0) and sends
    them in two copies: the per-row vectors, then the used part of the block tables. Building five pinned
    tensors per step, five copies and two fills cost host time the GPU waited for, each step.
    Decode graphs have one row a sequence (`stage`); with max_seqs, rows and sequences are counted apart and
    each sequence's first row (query_start) is staged too (`stage_step`)."""

    def __init__(self, max_batch: int, max_blocks: int, device: torch.device, max_seqs: int | None = None):
        n = self.max_batch = max_batch
        s = self.max_seqs = max_seqs or max_batch
        self.has_starts = max_seqs is not None
        self.work_items = prefill_work_items(n, s) if self.has_starts else 0
        pin = device.type == "cuda"
        # token ids, positions, slots (int64, a row each), then sequence lengths and, for steps, the sequences'
        # first rows and the prefill kernel's work list (int32): one byte buffer, one copy
        self.vector_bytes = 3 * 8 * n + 4 * s + (4 * (s + 1 + self.work_items) if self.has_starts else 0)
        self._host = torch.zeros(self.vector_bytes, dtype=torch.uint8, pin_memory=pin)
        self._device = torch.zeros(self.vector_bytes, dtype=torch.uint8, device=device)
        views = self._views(self._device)
        self.token_ids, self.positions, self.slot_mapping, self.seq_lens = views[:4]
        self.query_start, self.prefill_work = views[4:] if self.has_starts else (None, None)
        self._host_views = [t.numpy() for t in self._views(self._host)]
        self._host_views[2][:] = -1             # no slot: rows the capture runs write no KV
        if self.has_starts:
            self._host_views[5][:] = -1         # no work: the capture's attention reads and writes nothing
        self._device.copy_(self._host)
        self._host_tables = torch.zeros(s, max_blocks, dtype=torch.int32, pin_memory=pin)
        self._host_tables_np = self._host_tables.numpy()
        self.block_tables = torch.zeros(s, max_blocks, dtype=torch.int32, device=device)
        self._sent = torch.cuda.Event() if device.type == "cuda" else None

    def _views(self, buf: torch.Tensor) -> tuple[torch.Tensor, ...]:
        n, s = self.max_batch, self.max_seqs
        ids, pos, slots = buf[:24 * n].view(torch.int64).view(3, n)
        lens = buf[24 * n:24 * n + 4 * s].view(torch.int32)
        if not self.has_starts:
            return ids, pos, slots, lens
        starts_and_work = buf[24 * n + 4 * s:].view(torch.int32)
        return ids, pos, slots, lens, starts_and_work[:s + 1], starts_and_work[s + 1:]

    def stage(self, token_ids: list[int], positions: list[int], slot_mapping: list[int],
              block_tables: list[list[int]], bucket: int) -> None:
        """A decode step: one row a sequence, each of length position + 1."""
        n = len(token_ids)
        self._stage_rows(token_ids, positions, slot_mapping, bucket)
        lens = self._host_views[3]
        lens[:n] = self._host_views[1][:n] + 1
        lens[n:bucket] = 0
        self._send(block_tables)

    def stage_step(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
                   query_start: list[int], block_tables: list[list[int]], rows: int, seqs: int) -> None:
        """A step of len(seq_lens) sequences whose rows start at query_start (its last entry: the rows in all),
        in a bucket of `rows` rows and `seqs` sequences: the padding sequences have no rows and no length. The
        prefill kernel's work list (attention.prefill_work) names the step's query tiles, -1 past them."""
        assert self.has_starts and len(query_start) == len(seq_lens) + 1 == len(block_tables) + 1
        n, k = len(token_ids), len(seq_lens)
        self._stage_rows(token_ids, positions, slot_mapping, rows)
        lens, starts, work = self._host_views[3:]
        lens[:k], lens[k:seqs] = seq_lens, 0
        starts[:k + 1], starts[k + 1:seqs + 1] = query_start, n
        work[:] = prefill_work(query_start, seq_lens, items=self.work_items)
        self._send(block_tables)

    def _stage_rows(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], bucket: int) -> None:
        n = len(token_ids)
        if self._sent is not None:
            self._sent.synchronize()    # the previous step's copies have left the mirror (they have by now: the
                                        # step before it was collected, and they queue right behind it)
        ids, pos, slots = self._host_views[:3]
        ids[:n], pos[:n], slots[:n] = token_ids, positions, slot_mapping
        ids[n:bucket], pos[n:bucket], slots[n:bucket] = 0, 0, -1

    def _send(self, block_tables: list[list[int]]) -> None:
        k = len(block_tables)
        width = max(len(t) for t in block_tables)
        tables = self._host_tables_np
        for i, table in enumerate(block_tables):
            tables[i, :len(table)] = table      # entries past a row's length are never read (length bounds it)
        self._device.copy_(self._host, non_blocking=True)
        self.block_tables[:k, :width].copy_(self._host_tables[:k, :width], non_blocking=True)
        if self._sent is not None:
            self._sent.record()


def step_graph_rows(model, max_rows: int) -> list[int]:
    """The prefill steps' row buckets: STEP_ROWS up to the first that holds max_rows, those the model's forward can
    be captured at (models/llama.py's step_graph_holds: with experts routed by a host sync at some sizes, a step of
    such a size replays a bigger bucket or runs eagerly)."""
    return [r for r in _up_to(STEP_ROWS, max_rows) if model.step_graph_holds(r)]


class StepGraphs:
    """Graphs of the steps with prefill chunks (alone, or beside other sequences' chunks and decode rows), one
    per (rows, sequences) bucket of STEP_ROWS x STEP_SEQS up to the first that holds max_rows and max_seqs
    (never more sequences than rows): each returns the step's final hidden states, from which the runner takes
    the rows it samples (and prompt logprobs, embeddings)."""

    def __init__(self, model, pool, max_rows: int, max_seqs: int, max_context: int, quiet: bool = False,
                 mempool=None, seq_sizes: tuple[int, ...] = STEP_SEQS):
        dev = pool.k[0].device
        self.model, self.pool = model, pool
        # seq_sizes: the sequence buckets (bench/prefill_host.py --seq-sizes times others against these)
        self.rows, self.seqs = step_graph_rows(model, max_rows), _up_to(seq_sizes, max_seqs)
        assert self.rows, "the model's forward can be captured at no step size"
        self.max_rows, self.max_seqs = self.rows[-1], self.seqs[-1]
        self.max_blocks = -(-max_context // pool.block_size)
        self.max_context = self.max_blocks * pool.block_size
        self.inputs = StagedInputs(self.max_rows, self.max_blocks, dev, max_seqs=self.max_seqs)
        self.mempool = mempool if mempool is not None else torch.cuda.graph_pool_handle()
        buckets = [(r, s) for r in self.rows for s in self.seqs if s <= r]
        self.graphs, self.hidden = capture(buckets, self._forward, self.mempool, "capturing prefill graphs", quiet)

    def _forward(self, bucket: tuple[int, int]) -> torch.Tensor:
        rows, seqs = bucket
        i = self.inputs
        # max_query_len = the bucket's rows (any sequence's chunk fits); the prefill kernel's programs are the
        # work list's items that a step of this bucket can have
        meta = AttentionMetadata(i.slot_mapping[:rows], i.query_start[:seqs + 1], i.seq_lens[:seqs],
                                 i.block_tables[:seqs], max_query_len=rows, max_seq_len=self.max_context,
                                 prefill_work=i.prefill_work[:prefill_work_items(rows, seqs)])
        return self.model.forward(i.token_ids[:rows], i.positions[:rows], meta, self.pool.k, self.pool.v)

    def bucket_for(self, rows: int, seqs: int) -> tuple[int, int] | None:
        """The smallest bucket of at least `rows` rows and `seqs` sequences (no bucket has more sequences than
        rows), or None."""
        s = next((b for b in self.seqs if b >= seqs), None)
        r = next((b for b in self.rows if b >= max(rows, s or 0)), None)
        return None if r is None or s is None else (r, s)

    def run(self, token_ids: list[int], positions: list[int], slot_mapping: list[int], seq_lens: list[int],
            query_start: list[int], block_tables: list[list[int]]) -> torch.Tensor:
        """A step that bucket_for holds (host lists, as the eager step's metadata) -> its final hidden states
        [rows, d_model] (a view: use it before the next run)."""
        bucket = self.bucket_for(len(token_ids), len(seq_lens))
        self.inputs.stage_step(token_ids, positions, slot_mapping, seq_lens, query_start, block_tables, *bucket)
        self.graphs[bucket].replay()
        return self.hidden[bucket][:len(token_ids)]
