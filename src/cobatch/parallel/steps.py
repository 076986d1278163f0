"""Rank 0's steps, broadcast so that every tensor-parallel rank runs the same one.

Rank 0 runs the scheduler, the runner and the sampler; the other ranks hold only their shard and KV pool and
follow. Each forward pass rank 0 makes reaches them as a short header on a pipe (what runs, and the sizes) and its
inputs by broadcast over the group: a prefill / mixed step's token ids, positions and attention metadata; the
hidden rows whose logits it computes (the head is vocabulary-parallel, so every rank joins); a decode step through
the CUDA graphs, its staged input buffers and the bucket to replay (every rank captured the same graphs, the
all-reduces inside them). The header goes on a pipe rather than the group so that a follower waits for work
without a timeout, and sees rank 0 gone (EOF) as soon as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from cobatch.batch import AttentionMetadata
from cobatch.engine.cuda_graphs import DecodeGraphs
from cobatch.parallel.group import TensorParallelGroup

FORWARD, LOGITS, GRAPH, STOP = "forward", "logits", "graph", "stop"


def broadcast(tensors: list[torch.Tensor], tp: TensorParallelGroup) -> None:
    """Rank 0's tensors into the same-shaped ones of every other rank."""
    for t in tensors:
        dist.broadcast(t, 0, group=tp.group)


class StepLink:
    """Rank 0's end: the pipes to the other ranks, and the broadcasts that follow each header."""

    def __init__(self, tp: TensorParallelGroup, conns: list):
        self.tp, self.conns = tp, conns

    def send(self, *header) -> None:
        for conn in self.conns:
            conn.send(header)

    def broadcast(self, tensors: list[torch.Tensor]) -> None:
        broadcast(tensors, self.tp)

    def stop(self) -> None:
        for conn in self.conns:
            try:
                conn.send((STOP,))
            except (BrokenPipeError, OSError):
                pass


def _forward_inputs(token_ids, positions, meta: AttentionMetadata) -> list[torch.Tensor]:
    return [token_ids, positions, meta.slot_mapping, meta.query_start, meta.seq_lens, meta.block_tables]


class ParallelModel:
    """Rank 0's model as the runner sees it: each forward and logits call is sent to the other ranks first."""

    def __init__(self, model, link: StepLink):
        self.model, self.link = model, link

    def __getattr__(self, name: str):
        return getattr(self.model, name)

    def forward(self, token_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata, k_caches, v_caches
                ) -> torch.Tensor:
        token_ids = token_ids.to(torch.int64).contiguous()
        self.link.send(FORWARD, token_ids.shape[0], meta.num_seqs, meta.block_tables.shape[1], meta.max_query_len,
                       meta.max_seq_len)
        self.link.broadcast(_forward_inputs(token_ids, positions, meta))
        return self.model.forward(token_ids, positions, meta, k_caches, v_caches)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = hidden.contiguous()
        self.link.send(LOGITS, hidden.shape[0])
        self.link.broadcast([hidden])
        return self.model.logits(hidden)


class ParallelDecodeGraphs(DecodeGraphs):
    """The decode graphs of one rank (captured over the raw model, on every rank in the same order). On rank 0
    (link set) a step's staged inputs are broadcast before the replay; the other ranks `follow` them."""

    def __init__(self, model, pool, max_batch: int, max_context: int, quiet: bool = False,
                 link: StepLink | None = None):
        super().__init__(model, pool, max_batch, max_context, quiet)
        self.tp, self.link = model.tp, link

    def run(self, token_ids, positions, slot_mapping, block_tables, device_token_ids=None) -> torch.Tensor:
        b = self.bucket_for(len(token_ids))
        self.inputs.stage(token_ids, positions, slot_mapping, block_tables, b)
        if device_token_ids is not None:
            self.token_ids[:len(token_ids)].copy_(device_token_ids)
        width = max(len(t) for t in block_tables)
        self.link.send(GRAPH, b, width)
        self.link.broadcast(self._staged(b, width))
        self.graphs[b].replay()
        return self.logits[b][:len(token_ids)]

    def _staged(self, b: int, width: int) -> list[torch.Tensor]:
        # the staged vectors are one byte buffer (token ids, positions, slots, lengths); the tables' used part
        return [self.inputs._device, self.inputs.block_tables[:b, :width].contiguous()]

    def follow(self, b: int, width: int) -> None:
        staged = self._staged(b, width)
        broadcast(staged, self.tp)
        self.inputs.block_tables[:b, :width].copy_(staged[1])
        self.graphs[b].replay()


@torch.inference_mode()
def follow_steps(model, pool, conn, graphs: ParallelDecodeGraphs | None = None) -> None:
    """A rank > 0's loop: run each step rank 0 sends, until it says stop or is gone."""
    dev, tp = model.device, model.tp
    while True:
        try:
            header = conn.recv()
        except (EOFError, OSError):
            return
        op = header[0]
        if op == STOP:
            return
        if op == FORWARD:
            n, seqs, width, max_query_len, max_seq_len = header[1:]
            inputs = [torch.empty(n, dtype=torch.int64, device=dev), torch.empty(n, dtype=torch.int64, device=dev),
                      torch.empty(n, dtype=torch.int64, device=dev),
                      torch.empty(seqs + 1, dtype=torch.int32, device=dev),
                      torch.empty(seqs, dtype=torch.int32, device=dev),
                      torch.empty(seqs, width, dtype=torch.int32, device=dev)]
            broadcast(inputs, tp)
            token_ids, positions, slots, starts, lens, tables = inputs
            meta = AttentionMetadata(slots, starts, lens, tables, max_query_len, max_seq_len)
            model.forward(token_ids, positions, meta, pool.k, pool.v)
        elif op == LOGITS:
            hidden = torch.empty(header[1], model.cfg.d_model, dtype=model.dtype, device=dev)
            broadcast([hidden], tp)
            model.logits(hidden)
        elif op == GRAPH:
            graphs.follow(header[1], header[2])
        else:
            raise RuntimeError(f"unknown tensor-parallel step {op!r}")
