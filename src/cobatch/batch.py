"""What one forward pass needs to know about the sequences in it.

A step's rows are grouped by sequence: rows query_start[s]:query_start[s+1] belong to sequence s and
are its *last* q_len tokens, at positions seq_lens[s]-q_len .. seq_lens[s]-1. A decode step has one row
per sequence (max_query_len == 1); a prefill chunk has several. Padded rows (CUDA-graph buckets) have
slot -1, so they write no KV, and a sequence length of 0... they read nothing that matters.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor   # int64 [N]: flat KV slot (block * block_size + offset) each row writes; -1 = skip
    query_start: torch.Tensor    # int32 [S+1]: row offsets of each sequence (cumulative query lengths)
    seq_lens: torch.Tensor       # int32 [S]: context length of each sequence including this step's rows
    block_tables: torch.Tensor   # int32 [S, max_blocks]: KV block ids of each sequence (unused entries: 0)
    max_query_len: int           # host-side bound on q_len (1 for a pure decode step)
    max_seq_len: int             # host-side bound on seq_lens (a fixed capacity under CUDA graphs)
    # int32 [items]: the prefill kernel's (sequence, query tile) pairs, packed seq << 16 | tile, -1 past the last
    # (attention.prefill_work); None: its grid covers every sequence's tiles up to max_query_len
    prefill_work: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def is_decode(self) -> bool:
        return self.max_query_len == 1
