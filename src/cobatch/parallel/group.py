"""A tensor-parallel group: the processes that hold one model's shards, and the collectives its forward needs.

torch.distributed with a rendezvous on 127.0.0.1: NCCL for the activations on CUDA (NVLink multicast / NVLS off:
the GPUs are shared, and `NCCL_NVLS_ENABLE=0` is forced before NCCL starts), gloo on the CPU, and a gloo group
beside NCCL for the host-side values ranks agree on at load. Every collective has the group's timeout, so a rank
that stops answering fails the others instead of hanging them.

The model holds the group as its hook (`LlamaModel.tp`): all_reduce after each row-parallel projection, the
vocabulary-parallel embedding (each rank looks up the ids in its rows, zeros elsewhere, then one all-reduce), and
the vocabulary-parallel head (each rank's logits gathered in rank order). All three are plain collectives on the
current stream, so a decode step captured in a CUDA graph captures them too.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from cobatch.errors import UserError

# (torch 2.13 renamed all_gather_into_tensor, the older name now warns)
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
DEFAULT_TIMEOUT_S = 300.0    # load-time collectives wait for the slowest rank's load


def timeout_s() -> float:
    raw = os.environ.get("COBATCH_TP_TIMEOUT_S", "").strip()
    try:
        seconds = float(raw) if raw else DEFAULT_TIMEOUT_S
    except ValueError:
        seconds = 0.0
    if not 0 < seconds < float("inf"):
        raise UserError(f"$COBATCH_TP_TIMEOUT_S: a number of seconds above 0 (got {raw!r})")
    return seconds


@dataclass(eq=False)
class TensorParallelGroup:
    rank: int
    world: int
    device: torch.device
    group: object               # the activations' collectives (NCCL on CUDA, gloo on the CPU)
    host_group: object          # gloo: host values (KV block counts, the banner's figures)
    vocab_rows: int = 0         # the whole vocabulary's embedding rows, and this rank's share (set at load)
    vocab_per_rank: int = 0

    @classmethod
    def join(cls, rank: int, world: int, port: int, device: torch.device) -> "TensorParallelGroup":
        """Join the group of `world` processes rendezvousing on 127.0.0.1:port (rank 0 listens there)."""
        os.environ["NCCL_NVLS_ENABLE"] = "0"
        timeout = timedelta(seconds=timeout_s())
        if device.type == "cuda":
            torch.cuda.set_device(rank)
            device = torch.device("cuda", rank)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=timeout)
        group = dist.group.WORLD
        host = dist.new_group(backend="gloo", timeout=timeout) if backend == "nccl" else group
        return cls(rank, world, device, group, host)

    def leave(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()

    # --- the model's hook ----------------------------------------------------------------------
    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of every rank's partial x (a row-parallel projection's output)."""
        dist.all_reduce(x, group=self.group)
        return x

    def embed(self, table: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
        """Vocabulary-parallel lookup: table is this rank's rows; ids outside them contribute zeros."""
        local = token_ids - self.rank * self.vocab_per_rank
        inside = (local >= 0) & (local < table.shape[0])
        x = table[local.clamp(0, table.shape[0] - 1)] * inside[:, None].to(table.dtype)
        return self.all_reduce(x)

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor:
        """[rows, vocab_per_rank] of each rank -> [rows, vocab_rows], in vocabulary order."""
        rows, per = logits.shape
        parts = torch.empty(self.world * rows, per, dtype=logits.dtype, device=logits.device)
        _all_gather(parts, logits.contiguous(), group=self.group)
        return parts.view(self.world, rows, per).permute(1, 0, 2).reshape(rows, -1)[:, :self.vocab_rows]

    # --- host values ---------------------------------------------------------------------------
    def min_over_ranks(self, value: int) -> int:
        t = torch.tensor([value], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MIN, group=self.host_group)
        return int(t.item())

    def gather_objects(self, obj: object) -> list:
        out: list = [None] * self.world
        dist.all_gather_object(out, obj, group=self.host_group)
        return out
