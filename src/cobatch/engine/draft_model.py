"""Speculative decoding with a draft model: a smaller model of the same vocabulary (vLLM's draft_model method,
llama.cpp's --model-draft) proposes each decoding sequence's next k tokens, greedily, and the target model checks
them in its next step as it checks prompt-lookup drafts (engine/speculative.py: the output is plain decoding's
whatever the drafts are).

The draft model keeps its own paged KV cache, a table of blocks per sequence. Each step it proposes for all
drafting sequences together, in k forward passes: the first feeds each sequence's tokens its cache lacks (the
last one at least; the whole prompt the first time), each later one the draft before. What its cache holds is
remembered as the tokens fed, so after the target kept some drafts and replaced the rest, the next step feeds
again from the first token that differs: no rollback is needed, and stale entries past it are overwritten.
A sequence's blocks go back when it leaves the engine. Where the draft pool has no blocks left, a sequence
gets no drafts that step.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field

import torch

from cobatch import ops
from cobatch.batch import AttentionMetadata
from cobatch.engine.kv_cache import BlockManager, KVPool
from cobatch.engine.sampler import to_device
from cobatch.engine.sequence import Sequence


@dataclass(slots=True)
class _Cached:
    """One sequence's entries in the draft cache: its blocks, and the tokens whose K/V they hold, in order. The
    first `settled` of them were the sequence's own when fed (its tokens are never rewritten), so only the drafts
    after them need comparing."""
    blocks: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    settled: int = 0

    def valid(self, token_ids: list[int]) -> int:
        """How many of its tokens are the sequence's first ones: its entries to keep."""
        i, n = self.settled, min(len(self.tokens), len(token_ids))
        while i < n and self.tokens[i] == token_ids[i]:          # at most a step's drafts
            i += 1
        return i


class DraftModel:
    def __init__(self, model, pool: KVPool, target_vocab: int, graphs=None):
        """graphs: the draft model's decode graphs (engine/cuda_graphs.DecodeGraphs over `pool`, CUDA): a pass that
        feeds one token a sequence replays one instead of launching each kernel."""
        self.model, self.pool, self.graphs = model, pool, graphs
        self.blocks = BlockManager(pool.num_blocks, pool.block_size)     # no prefix cache: a draft's KV is cheap
        self.device = pool.k[0].device
        self.target_vocab = target_vocab
        self.cached: dict[str, _Cached] = {}

    def release_gone(self, live: Collection[str]) -> None:
        """Give back the blocks of sequences no longer in the engine."""
        for request_id in [r for r in self.cached if r not in live]:
            self.blocks.release(self.cached.pop(request_id).blocks)

    @torch.inference_mode()
    def propose(self, seqs: list[Sequence], limits: list[int]) -> dict[str, list[int]]:
        """Up to limits[i] greedy drafts for each sequence (request id -> drafts); fewer where the pool is full or
        a draft falls outside the target's vocabulary."""
        bs = self.pool.block_size
        work = []            # (sequence, its cache entry, first token to feed, limit)
        for seq, limit in zip(seqs, limits):
            if limit <= 0:
                continue
            entry = self.cached.setdefault(seq.request_id, _Cached())
            start = min(entry.valid(seq.token_ids), len(seq.token_ids) - 1)
            # positions up to the last token's and its drafts' but the last
            need = -(-(len(seq.token_ids) + limit - 1) // bs) - len(entry.blocks)
            got = self.blocks.allocate(need) if need > 0 else []
            if got is None:
                continue
            entry.blocks += got
            del entry.tokens[start:]
            entry.settled = len(seq.token_ids)      # what pass 0 feeds ends there; the passes after feed drafts
            work.append((seq, entry, start, limit))
        drafts: dict[str, list[int]] = {seq.request_id: [] for seq, _, _, _ in work}
        # pass 0 feeds each sequence's missing tokens, pass j > 0 the draft of pass j - 1: (seq, entry, tokens fed,
        # position of the first, drafts still wanted)
        feeds = [(seq, entry, seq.token_ids[start:], start, limit) for seq, entry, start, limit in work]
        while feeds:
            next_feeds = []
            for (seq, entry, fed, first, left), token in zip(feeds, self._greedy_next(feeds)):
                entry.tokens += fed
                if token >= self.target_vocab:          # (a draft vocabulary's rows past the target's)
                    continue
                drafts[seq.request_id].append(token)
                if left > 1:
                    next_feeds.append((seq, entry, [token], first + len(fed), left - 1))
            feeds = next_feeds
        return drafts

    def _greedy_next(self, feeds: list[tuple[Sequence, _Cached, list[int], int, int]]) -> list[int]:
        """One forward pass of the draft model over each sequence's fed tokens (at positions first..): the greedy
        token of each sequence's last row (as the sampler picks it at temperature 0)."""
        bs = self.pool.block_size
        if self.graphs is not None and len(feeds) <= self.graphs.max_batch and all(len(f[2]) == 1 for f in feeds):
            positions = [first for _, _, _, first, _ in feeds]
            logits = self.graphs.run(token_ids=[fed[0] for _, _, fed, _, _ in feeds], positions=positions,
                                     slot_mapping=[entry.blocks[p // bs] * bs + p % bs
                                                   for (_, entry, _, _, _), p in zip(feeds, positions)],
                                     block_tables=[entry.blocks for _, entry, _, _, _ in feeds])
            return ops.greedy_tokens(logits).tolist()
        ids, pos, slots, starts, lens, tables = [], [], [], [0], [], []
        for _, entry, fed, first, _ in feeds:
            ids += fed
            positions = range(first, first + len(fed))
            pos += positions
            slots += [entry.blocks[p // bs] * bs + p % bs for p in positions]
            starts.append(starts[-1] + len(fed))
            lens.append(first + len(fed))
            tables.append(entry.blocks)
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=to_device(slots, torch.int64, dev), query_start=to_device(starts, torch.int32, dev),
            seq_lens=to_device(lens, torch.int32, dev),
            block_tables=to_device([t + [0] * (width - len(t)) for t in tables], torch.int32, dev),
            max_query_len=max(len(fed) for _, _, fed, _, _ in feeds), max_seq_len=max(lens))
        hidden = self.model.forward(to_device(ids, torch.int64, dev), to_device(pos, torch.int64, dev), meta,
                                    self.pool.k, self.pool.v)
        last = hidden[to_device([s - 1 for s in starts[1:]], torch.int64, dev)]
        return ops.greedy_tokens(self.model.logits(last)).tolist()
