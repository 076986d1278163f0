"""Each tensor-parallel rank's part of a GGUF's weights, cut from the file's own blocks at load.

Megatron's split: q|k|v and gate|up are column-parallel (a rank holds whole heads, KV heads included, and a slice
of the feed-forward width: its rows of the matrix), o and down are row-parallel (the matching slice of their input
features, K; each rank's product is a partial sum the forward all-reduces). The embedding and the output head are
split by vocabulary rows. A GGUF matrix is stored as rows of blocks, so a column-parallel split is a row slice of
the raw bytes (a view of the memory map); a row-parallel one takes a byte range of every row, which must fall on
the format's block boundaries (32 or 256 values). Experts are split like the dense feed-forward, each expert by
itself. Norms, biases of whole heads' rows and the router are replicated or sliced alike. Nothing goes through a
dense copy: a rank reads (and, on the GPU, repacks) only its own blocks.

`ShardedGGUF` answers the loader's questions (`tensors`, `quant_weight`, `float_tensor`) with the rank's part, so
the model is built by the same code as on one GPU, from a config whose head and width counts are the rank's.
"""

from __future__ import annotations

import dataclasses
import re

import torch

from cobatch.config import ModelConfig
from cobatch.errors import UserError
from cobatch.quant.weight import QuantWeight


def shard_config(cfg: ModelConfig, world: int) -> ModelConfig:
    """The config of one rank's shard: its heads and its slice of the feed-forward widths."""
    return dataclasses.replace(cfg, n_heads=cfg.n_heads // world, n_kv_heads=cfg.n_kv_heads // world,
                               ffn_dim=cfg.ffn_dim // world, expert_ffn_dim=cfg.expert_ffn_dim // world,
                               shared_expert_ffn_dim=cfg.shared_expert_ffn_dim // world)


def vocab_rows_per_rank(vocab_rows: int, world: int) -> int:
    """Embedding / head rows each rank holds: the vocabulary split evenly, the last rank's part padded."""
    return -(-vocab_rows // world)


# Row-parallel matrices: their input features (K) are split; name -> the width K is cut into.
_ROW_PARALLEL = {"attn_output.weight": "q", "ffn_down.weight": "ffn", "ffn_down_exps.weight": "expert",
                 "ffn_down_shexp.weight": "shared"}


def check_tensor_parallel(cfg: ModelConfig, gguf, world: int) -> None:
    """A UserError (one line) unless this model splits over `world` ranks: whole KV heads per rank, the widths
    divisible, and every row-parallel split on its format's block boundaries. Reads the header only."""
    if world < 1:
        raise UserError(f"--tensor-parallel-size must be at least 1 (got {world})")
    if world == 1:
        return
    if cfg.n_kv_heads % world:
        raise UserError(f"--tensor-parallel-size {world} does not divide the model's {cfg.n_kv_heads} KV heads "
                        f"(each rank holds whole KV heads: choose a divisor of {cfg.n_kv_heads})")
    widths = {"ffn": cfg.ffn_dim, "expert": cfg.expert_ffn_dim, "shared": cfg.shared_expert_ffn_dim}
    for name, width in widths.items():
        if width % world:
            raise UserError(f"--tensor-parallel-size {world} does not divide the {name} width {width}")
    widths["q"] = cfg.n_heads * cfg.head_dim
    for tensor in gguf.tensors:
        kind = next((k for suffix, k in _ROW_PARALLEL.items() if tensor.endswith(suffix)), None)
        if kind is None:
            continue
        part, fmt = widths[kind] // world, gguf.quant_weight(tensor).fmt
        if part % fmt.block_size:
            raise UserError(f"--tensor-parallel-size {world}: {tensor} ({fmt.name}) would be split into "
                            f"{part} input columns per rank, not a whole number of its {fmt.block_size}-value "
                            "blocks")


def column_slice(w: QuantWeight, start: int, stop: int) -> QuantWeight:
    """Input features start..stop-1 of every row (block-aligned): a copy of just those blocks."""
    fmt = w.fmt
    lo, hi = fmt.row_bytes(start), fmt.row_bytes(stop)
    return QuantWeight(fmt, w.rows, stop - start, w.raw[:, lo:hi].contiguous())


def _rows(w: QuantWeight, ranges: list[tuple[int, int]]) -> QuantWeight:
    """The rows of several ranges, stacked (one range: a view)."""
    if len(ranges) == 1:
        return w.row_slice(*ranges[0])
    return QuantWeight(w.fmt, sum(b - a for a, b in ranges), w.cols, torch.cat([w.raw[a:b] for a, b in ranges]))


class ShardedGGUF:
    """A GGUFFile as one tensor-parallel rank sees it: every tensor its part (see the module's notes)."""

    def __init__(self, gguf, cfg: ModelConfig, rank: int, world: int):
        self.gguf, self.cfg, self.rank, self.world = gguf, cfg, rank, world
        self.tensors = gguf.tensors
        self.metadata = gguf.metadata
        self.vocab_rows = gguf.quant_weight("token_embd.weight").rows
        self.vocab_per_rank = vocab_rows_per_rank(self.vocab_rows, world)

    def _part(self, width: int) -> tuple[int, int]:
        per = width // self.world
        return self.rank * per, (self.rank + 1) * per

    def _head_rows(self) -> dict[str, list[tuple[int, int]]]:
        """Row ranges of q, k and v (in the fused q|k|v numbering too) that hold this rank's heads."""
        cfg = self.cfg
        q, kv = cfg.n_heads * cfg.head_dim, cfg.n_kv_heads * cfg.head_dim
        (q0, q1), (k0, k1) = self._part(q), self._part(kv)
        return {"q": [(q0, q1)], "k": [(k0, k1)], "v": [(k0, k1)],
                "qkv": [(q0, q1), (q + k0, q + k1), (q + kv + k0, q + kv + k1)]}

    def _rows_of(self, name: str, rows: int) -> list[tuple[int, int]] | None:
        """The row ranges of a column-parallel tensor (None: not split by rows)."""
        cfg, leaf = self.cfg, re.sub(r"^blk\.\d+\.", "", name)
        heads = self._head_rows()
        if m := re.fullmatch(r"attn_([qkv]|qkv)\.(weight|bias)", leaf):
            return heads[m.group(1)]
        if leaf in ("ffn_gate.weight", "ffn_up.weight") and rows == cfg.ffn_dim:
            return [self._part(cfg.ffn_dim)]
        if leaf == "ffn_up.weight":         # phi3: gate|up stored as one tensor, gate first
            (a, b) = self._part(cfg.ffn_dim)
            return [(a, b), (cfg.ffn_dim + a, cfg.ffn_dim + b)]
        if leaf in ("ffn_gate_exps.weight", "ffn_up_exps.weight"):
            per = cfg.expert_ffn_dim
            a, b = self._part(per)
            return [(e * per + a, e * per + b) for e in range(cfg.n_experts)]
        if leaf in ("ffn_gate_shexp.weight", "ffn_up_shexp.weight"):
            return [self._part(cfg.shared_expert_ffn_dim)]
        return None

    def quant_weight(self, name: str) -> QuantWeight:
        w = self.gguf.quant_weight(name)
        if name in ("token_embd.weight", "output.weight"):
            return self._vocab_part(w)
        kind = next((k for suffix, k in _ROW_PARALLEL.items() if name.endswith(suffix)), None)
        if kind is not None:
            return column_slice(w, *self._part(w.cols))
        ranges = self._rows_of(name, w.rows)
        return w if ranges is None else _rows(w, ranges)

    def float_tensor(self, name: str) -> torch.Tensor:
        t = self.gguf.float_tensor(name)
        ranges = self._rows_of(name, t.shape[0])
        return t if ranges is None else torch.cat([t[a:b] for a, b in ranges])

    def _vocab_part(self, w: QuantWeight) -> QuantWeight:
        """This rank's vocabulary rows, the last rank's padded with all-zero blocks (they decode to 0)."""
        per = self.vocab_per_rank
        start, stop = self.rank * per, min((self.rank + 1) * per, w.rows)
        part = w.row_slice(start, stop)
        if stop - start == per:
            return part
        pad = torch.zeros(per - (stop - start), w.raw.shape[1], dtype=torch.uint8)
        return QuantWeight(w.fmt, per, w.cols, torch.cat([part.raw, pad]))


def sharding_banner(cfg: ModelConfig, ranks: list[tuple[int, int, int, int]], block_size: int,
                    dtype: torch.dtype) -> str:
    """The start-up lines of a tensor-parallel model: each rank's weights and KV pool (ranks: per rank, its
    (resident bytes, quantized bytes, KV blocks, KV bytes)), and what the collectives move per step."""
    mib = 2 ** 20
    lines = [f"tensor parallel: {len(ranks)} ranks, {cfg.n_kv_heads // len(ranks)} of {cfg.n_kv_heads} KV heads "
             f"and 1/{len(ranks)} of the feed-forward and vocabulary each"]
    for rank, (held, quantized, blocks, kv_bytes) in enumerate(ranks):
        lines.append(f"  rank {rank}: weights {held / mib:.1f} MiB ({quantized / mib:.1f} MiB quantized), "
                     f"KV {blocks} blocks x {block_size} = {blocks * block_size} tokens ({kv_bytes / mib:.1f} MiB)")
    item = torch.empty(0, dtype=dtype).element_size()
    reduces = 2 * cfg.n_layers + 1          # o and down per layer, and the embedding
    row = reduces * cfg.d_model * item
    lines.append(f"  all-reduce: {reduces} per step ({2} per layer + the embedding) of {cfg.d_model} x {item} B "
                 f"= {row / 1024:.1f} KiB per token row; logits all-gather {cfg.vocab_size} x {item} B "
                 f"= {cfg.vocab_size * item / 1024:.1f} KiB per sampled row")
    return "\n".join(lines)
