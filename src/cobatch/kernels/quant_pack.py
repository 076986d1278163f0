"""Repack GGUF blocks once at load into planes the quantized-matmul kernels read with wide coalesced loads.

GGUF interleaves each block's scale with its quants (34-byte q8_0 blocks, 144-byte q4_K super-blocks), so
a row of blocks cannot be read in 16-byte vectors. Here every field gets its own contiguous plane,
row-major [rows_pad, ...]:

  qs     quants. q8_0: one byte per weight (the int8 bits, stored as uint8). 4-bit formats and q6_K's low
         nibbles: one byte per two weights, paired within each 64-weight chunk: byte l of chunk c holds
         weight 64c+l in its low nibble and weight 64c+32+l in its high nibble (q4_K's and q5_K's own GGUF
         order; q4_0/q4_1/q5_0/q5_1 pair within 32-blocks in GGUF and are re-paired here). So "the low
         nibbles of a chunk" and "the high nibbles" are each one whole 32-weight block.
  d      scale. f16 per 32-block (q8_0, q4_0, q4_1, q5_0, q5_1); q4_K, q5_K: f16 pairs (d, dmin) per
         256-super-block; q6_K: f32 per super-block (4 bytes, so the load can be an async copy; cp.async
         moves >= 4 bytes).
  m      q4_1, q5_1: f16 min per 32-block.
  sub    q4_K, q5_K: uint8 pairs (6-bit scale, 6-bit min) per 32-block; q6_K: int8 scale per 16 weights.
  qh     int32 high bits: the 5-bit formats (q5_0, q5_1, q5_K) one word per 32-block (bit j is bit 4 of
         weight j); q6_K one word per 16 weights (bits 2j, 2j+1 are bits 4, 5 of weight j). In fragment
         order, bytes beside the qs tiles (fifth_bits_to_fragment_order, 4 a lane; q6_K's
         high_bits_to_fragment_order, 8 a lane).
The checkpoint formats (loader/hf.py) hold a row scale (QuantWeight.row_scale: per channel, or the tensor's
repeated). FP8 (fp8_e4m3) has q8_0's planes, in either order: qs one e4m3 byte per weight, d the row scale
times FP8_D_SCALE as an f16 per 32-block (fp8_packable: scales f16 holds as normal numbers), so only the kernels'
byte decode differs: the GEMV moves an e4m3 byte's bits into an f16 that reads as its value / FP8_D_SCALE.
NVFP4: qs the e2m1 codes paired within 64-weight chunks as the 4-bit formats', sub its e4m3 block scale bytes (one
per 16: q6_K's int8 scales' place), d the f32 row scale [rows_pad, 1] (in fragment order a 4-byte entry a row).
In fragment order, FP8's and NVFP4's qs words then have their bits moved where the kernels decode them in the
fewest instructions (to_decode_order).

Bytes are the GGUF bytes except: q4_K's and q5_K's 12 packed bytes of 6-bit scales/mins become 16 plain bytes
(148 bytes per 256 weights instead of 144, +2.8 %; q5_K 180 instead of 176), q6_K's f16 d becomes f32 (212
instead of 210, +1 %).
`nbytes` counts what the kernels really read.
Rows are padded to a multiple of 128 and columns to a multiple of 256 with zero blocks, so the kernels
load whole tiles without masks; the padding reads as 0.

Fragment order (`fragment=True`, the CUDA layout of the packed formats for quant_gemv.py): the qs
plane is cut into 16-row x 32-byte tiles (a "chunk": 32 weights of q8_0, 64 of the others), stored
[row tile, chunk, 512 bytes], and inside a tile lane L of a warp owns bytes 16 L .. 16 L + 15: exactly the
bytes of its mma.sync A fragments (`fragment_order`). Same bytes, another order; inside each tile the
columns are also reordered (`k_order`) so that each lane's activations are contiguous.
The side planes (d, m, sub) of a fragment-order weight are cut into the same 16-row tiles, stored
[row tile, entry, 16 rows] with the rows in the order g, g + 8 for g = 0..7 (`side_to_fragment_order`):
the lanes of one warp load the 16 rows of an entry from one 32- or 64-byte piece of memory, where the
row-major plane spread them over 16 pieces (one per row, each a separate memory transaction).
An "entry" is what a row needs per K position: an f16 scale or min per 32-block; q4_K's 4 bytes of
(scale, min) per 64-weight chunk and its f16 (d, dmin) pair per super-block; q6_K's 4 int8 scales per chunk
and its f32 d. q6_K's high bits become a plane of 8 bytes per lane and tile (`high_bits_to_fragment_order`), the
5-bit formats' fifth bits one of 4 (`fifth_bits_to_fragment_order`).
q4_1's scale and offset planes (and q4_K's, repacked as q4_1's; q5_1's and q5_K's alike) become one plane, `d`,
with the 8 values a lane group needs per tile and chunk side by side (`affine_sides_to_fragment_order`); `m` is
then None.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cobatch.quant.formats import E2M1_VALUES, QuantFormat, _k_scales_mins, _pack_bits_32, _unpack, format_of

# Format ids: the kernels' FMT constexpr.
Q8_0, Q4_0, Q4_1, Q5_0, Q4_K, Q6_K, FP8_E4M3, NVFP4, Q5_1, Q5_K = range(10)
PACKED_FORMATS = {"q8_0": Q8_0, "q4_0": Q4_0, "q4_1": Q4_1, "q5_0": Q5_0, "q5_1": Q5_1, "q4_k": Q4_K, "q5_k": Q5_K,
                  "q6_k": Q6_K, "fp8_e4m3": FP8_E4M3, "nvfp4": NVFP4}
ROW_SCALED = (FP8_E4M3, NVFP4)      # the checkpoint formats: a row scale beside the blocks (QuantWeight.row_scale)
BYTE_FORMATS = (Q8_0, FP8_E4M3)     # one byte a weight and an f16 scale per 32: the same planes
# whose planes may be in fragment order
FRAGMENT_FORMATS = (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K, Q6_K, FP8_E4M3, NVFP4)
FIFTH_BIT_FORMATS = (Q5_0, Q5_1, Q5_K)   # 4-bit nibbles and a fifth bit a weight (a qh word per 32-block)
AFFINE_FORMATS = (Q4_1, Q5_1, Q4_K, Q5_K)   # w = scale q + offset: in fragment order q4_1's or q5_1's planes
SCALED_BY_16 = (Q6_K, NVFP4)        # a scale every 16 weights: each k16 half of a tile keeps its own columns (k_order)

# FP8's d is its row scale times this: the GEMV's e4m3 decode (quant_gemv.ASM_FP8) moves a byte's bits into an f16
# whose exponent bias is 8 more than e4m3's, so it reads as the value times 2^-8, exactly.
FP8_D_SCALE = 256.0

ROW_PAD = 128    # largest BN any config uses
COL_PAD = 256    # largest BK; also the K-quant super-block
_ROWS_PER_CHUNK = 4096  # repack this many rows at a time, to bound the temporaries on the device


@dataclass(slots=True)
class PackedPlanes:
    fmt_id: int              # the planes' layout: fragment-order q4_K planes are q4_1's (_q4k_as_affine)
    rows: int
    cols: int
    rows_pad: int
    cols_pad: int
    qs: torch.Tensor
    d: torch.Tensor
    m: torch.Tensor | None = None
    sub: torch.Tensor | None = None
    qh: torch.Tensor | None = None
    fragment: bool = False   # qs in fragment order [rows_pad / 16, chunks * 512], side planes [rows_pad / 16, ...]

    def row_tiles(self, start: int, stop: int) -> "PackedPlanes":
        """A view of fragment-order planes' 16-row tiles start .. stop - 1 (no copy): rows 16 start .. as a
        matrix of their own (one expert of a stack, kernels/packed_experts.py)."""
        assert self.fragment
        rows = 16 * (stop - start)
        part = (lambda plane: None if plane is None else plane[start:stop])
        return PackedPlanes(self.fmt_id, rows, self.cols, rows, self.cols_pad, part(self.qs), part(self.d),
                            part(self.m), part(self.sub), part(self.qh), fragment=True)

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.qs, self.d, self.m, self.sub, self.qh) if t is not None]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _round_up(n: int, m: int) -> int:
    return (n + m - 1) // m * m


def _f16_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    """[..., n_blocks, type_size] uint8 -> [..., n_blocks] f16 of the field at `offset`."""
    return blocks[..., offset:offset + 2].contiguous().view(torch.float16).squeeze(-1)


def _u32_field(blocks: torch.Tensor, offset: int) -> torch.Tensor:
    return blocks[..., offset:offset + 4].contiguous().view(torch.int32).squeeze(-1)


def _gguf_nibbles_32(qs: torch.Tensor) -> torch.Tensor:
    """GGUF 32-block nibbles [..., nb, 16] -> values [..., nb*32] in weight order (byte j: weights j, j+16)."""
    return torch.cat([qs & 15, qs >> 4], dim=-1).flatten(-2)


def pack_nibbles_64(values: torch.Tensor) -> torch.Tensor:
    """4-bit values [..., K] (K % 64 == 0) -> bytes [..., K/2]: byte l of chunk c = w[64c+l] | w[64c+32+l] << 4."""
    v = values.reshape(*values.shape[:-1], -1, 2, 32)
    return (v[..., 0, :] | (v[..., 1, :] << 4)).flatten(-2)


def _pack_chunk(fmt_id: int, raw: torch.Tensor, cols: int, scale: torch.Tensor | None) -> dict[str, torch.Tensor]:
    """One chunk of rows: raw uint8 [r, row_bytes] with cols already a multiple of COL_PAD; scale: the rows'
    row scale (the checkpoint formats)."""
    r = raw.shape[0]
    if fmt_id == FP8_E4M3:         # q8_0's planes: the row scale (times FP8_D_SCALE) as each 32-block's f16 d
        d = (scale.float() * FP8_D_SCALE).half()
        return {"qs": raw[:, :cols], "d": d[:, None].expand(r, cols // 32).contiguous()}
    if fmt_id == NVFP4:            # 9-byte blocks of 16: the e4m3 scale, then codes 2 i (low nibble), 2 i + 1
        b = raw.view(r, cols // 16, 9)
        codes = torch.stack([b[..., 1:] & 15, b[..., 1:] >> 4], dim=-1).reshape(r, cols)
        return {"qs": pack_nibbles_64(codes), "sub": b[..., 0].contiguous(), "d": scale.float()[:, None]}
    if fmt_id == Q8_0:
        b = raw.view(r, cols // 32, 34)
        return {"qs": b[..., 2:].reshape(r, cols), "d": _f16_field(b, 0)}
    if fmt_id in (Q4_0, Q4_1, Q5_0, Q5_1):     # [d][m][qh][16 bytes of nibbles] per 32-block
        affine, fifth = fmt_id in AFFINE_FORMATS, fmt_id in FIFTH_BIT_FORMATS
        size = 18 + 2 * affine + 4 * fifth
        b = raw.view(r, cols // 32, size)
        out = {"qs": pack_nibbles_64(_gguf_nibbles_32(b[..., size - 16:])), "d": _f16_field(b, 0)}
        if affine:
            out["m"] = _f16_field(b, 2)
        if fifth:
            out["qh"] = _u32_field(b, 2 + 2 * affine)
        return out
    if fmt_id in (Q4_K, Q5_K):     # [d, dmin][12 bytes of 6-bit scales, mins][q5_K: 32 bytes of fifth bits][nibbles]
        size = 176 if fmt_id == Q5_K else 144
        b = raw.view(r, cols // 256, size)
        scales, mins = _k_scales_mins(b[..., 4:16].reshape(-1, 12))
        out = {"qs": b[..., size - 128:].reshape(r, cols // 2), "d": b[..., 0:4].reshape(r, -1).view(torch.float16),
               "sub": torch.stack([scales, mins], dim=-1).reshape(r, cols // 16)}
        if fmt_id == Q5_K:       # bit i of byte l: weight l of the super-block's 32-block i -> a word per block
            out["qh"] = _fifth_bit_words(_unpack(b[..., 16:48], 1).reshape(r, cols))      # [r, super, block, l]
        return out
    if fmt_id == Q6_K:
        b = raw.view(r, cols // 256, 210)
        ql = b[..., :128].reshape(r, -1, 2, 64)           # per 128-half: 64 bytes of low nibbles
        low = torch.cat([ql & 15, ql >> 4], dim=-1)        # [r, ns, 2, 128]: weights 128h + i
        qh = b[..., 128:192].reshape(r, -1, 2, 1, 32)      # byte l of a half: 2 bits of weights l+32i
        high = (qh >> torch.tensor([0, 2, 4, 6], dtype=torch.uint8, device=raw.device).view(4, 1)) & 3
        low = low.reshape(r, cols)
        return {"qs": pack_nibbles_64(low), "d": _f16_field(b, 208).float(),
                "sub": b[..., 192:208].reshape(r, cols // 16).view(torch.int8),
                "qh": _q6_high_words(high.reshape(r, cols))}              # [.., 2, 4, 32] -> weight order
    raise ValueError(fmt_id)


def k_order(fmt_id: int) -> list[int]:
    """The column order inside each 32-column tile of a fragment-order plane: logical column k (the mma's
    K index) holds the weights of GGUF column k_order[k] of the tile (of the 32-block; for the 4-bit
    formats, of both blocks a byte pairs).

    Why: the mma.sync B fragment gives lane 4 g + c the logical columns 2 c + {0, 1, 8, 9} of each k16
    half. In GGUF order those are four 4-byte pieces of the activation row, four loads per lane and token.
    Reordered, they are contiguous: lane c reads one 16-byte vector (GGUF columns 8 c .. 8 c + 7). The
    dot product does not care which order K is summed in, as long as weights and activations agree.
    q6_K's and NVFP4's scales change every 16 weights, so their order stays inside each k16 half (an 8-byte vector
    per half: columns 16 h + 4 c .. 16 h + 4 c + 3)."""
    order = []
    for k in range(32):
        half, pair, c, e = k // 16, (k // 8) % 2, (k // 2) % 4, k % 2     # k = 16 half + 8 pair + 2 c + e
        if fmt_id in SCALED_BY_16:
            order.append(16 * half + 4 * c + 2 * pair + e)
        else:
            order.append(8 * c + 4 * half + 2 * pair + e)
    return order


def fragment_order(fmt_id: int, device=None) -> torch.Tensor:
    """Where each byte of a fragment-order tile comes from: [512] int64 indexes into the row-major
    16 x 32 tile (row * 32 + col), position 16 L + p being byte p of lane L.

    Lane L = 4 g + c holds rows g and g + 8 and, per 4-byte word j, logical columns 8 j + 2 c and
    8 j + 2 c + 1 (the mma.sync m16n8k16 A fragment), i.e. the GGUF columns k_order gives for them.
    Word byte b: row g + 8 (b & 1), logical column 8 j + 2 c + (b >> 1), so that masking a word with
    0x00FF00FF-style patterns yields one row's (k, k + 1) pair in a register."""
    lane = torch.arange(32, device=device)[:, None]
    p = torch.arange(16, device=device)[None, :]
    g, c, j, b = lane // 4, lane % 4, p // 4, p % 4
    row = g + 8 * (b & 1)
    col = torch.tensor(k_order(fmt_id), device=device)[8 * j + 2 * c + (b >> 1)]
    return (row * 32 + col).reshape(512)


def to_fragment_order(qs: torch.Tensor, fmt_id: int) -> torch.Tensor:
    """Row-major qs [rows, chunks * 32] (rows % 16 == 0) -> [rows / 16, chunks * 512]."""
    r, n = qs.shape[0] // 16, qs.shape[1] // 32
    tiles = qs.reshape(r, 16, n, 32).permute(0, 2, 1, 3).reshape(r, n, 512)
    return tiles[..., fragment_order(fmt_id, qs.device)].reshape(r, n * 512)


def from_fragment_order(frag: torch.Tensor, fmt_id: int) -> torch.Tensor:
    """The inverse of to_fragment_order."""
    r, n = frag.shape[0], frag.shape[1] // 512
    tiles = torch.empty(r, n, 512, dtype=frag.dtype, device=frag.device)
    tiles[..., fragment_order(fmt_id, frag.device)] = frag.reshape(r, n, 512)
    return tiles.reshape(r, n, 16, 32).permute(0, 2, 1, 3).reshape(r * 16, n * 32)


# Decode order (the checkpoint formats, whose kernels decode by integer bit moves): inside each 4-byte word of a
# fragment-order qs plane, the bits of each weight are moved to where the kernel's decode (quant_gemv.ASM_FP8,
# ASM_FP4) takes them in the fewest instructions. A word holds f16x2 operands whose half 0 comes from fragment
# byte b and half 1 from byte b + 2; each value belongs at f16's sign bit 15 and the bits below its exponent's
# top (bits 13..7 for an e4m3 byte, 11..9 for an e2m1 code). Operand 0's values are stored there already, the
# others where one shift, or two and a mask (NVFP4's last two: one multiply by two powers of 2), put them.
# DECODE_SLOTS[fmt][operand] = (bit of the value's low field, bit of its sign) for half 0 (half 1: 16 higher).
# FP8: operand b & 1 is byte b (bits 0..6 the field, 7 the sign): 5 instructions a word where bytes in place took 7.
# NVFP4: operand (b & 1) + 2 nibble is a code (bits 0..2 e1 e0 m, 3 the sign): 9 where codes in place took 15.
DECODE_SLOTS = {FP8_E4M3: ((7, 15), (0, 14)), NVFP4: ((9, 15), (6, 12), (0, 13), (3, 14))}


def _decode_fields(fmt_id: int) -> list[tuple[int, int, int, int]]:
    """(byte, bit in the byte, width, bit in the decode-order word) of each field of a word's values."""
    fields = []
    for byte in range(4):
        half = 16 * (byte >> 1)
        values = [(0, 7)] if fmt_id == FP8_E4M3 else [(0, 3), (4, 3)]          # (first bit, width) of each value
        for v, (bit, width) in enumerate(values):
            low, sign = DECODE_SLOTS[fmt_id][(byte & 1) + 2 * v]
            fields += [(byte, bit, width, low + half), (byte, bit + width, 1, sign + half)]
    return fields


def to_decode_order(frag: torch.Tensor, fmt_id: int) -> torch.Tensor:
    """Fragment-order qs bytes of a DECODE_SLOTS format (last dim % 4 == 0) -> the same words in decode order."""
    b = frag.reshape(*frag.shape[:-1], -1, 4).long()
    word = sum(((b[..., byte] >> bit) & ((1 << width) - 1)) << to for byte, bit, width, to in _decode_fields(fmt_id))
    return (word[..., None] >> torch.arange(0, 32, 8, device=frag.device) & 255).to(torch.uint8).reshape(frag.shape)


def from_decode_order(words: torch.Tensor, fmt_id: int) -> torch.Tensor:
    """The inverse of to_decode_order."""
    b = words.reshape(*words.shape[:-1], -1, 4).long()
    word = (b << torch.arange(0, 32, 8, device=words.device)).sum(-1)
    out = torch.zeros_like(b)
    for byte, bit, width, at in _decode_fields(fmt_id):
        out[..., byte] |= ((word >> at) & ((1 << width) - 1)) << bit
    return out.to(torch.uint8).reshape(words.shape)


# Row r of a 16-row tile sits at position 2 (r % 8) + r // 8 of its side entry: lane group g of an
# mma.sync fragment holds rows g and g + 8, which thus lie side by side.
_SIDE_ROWS = [p // 2 + 8 * (p % 2) for p in range(16)]   # the row at each position


def _side_entry_bytes(fmt_id: int) -> int:
    # q6_K: 4 int8 scales per 64 weights and an f32 d; NVFP4: 4 e4m3 scales per 64 weights and the f32 row scale;
    # else f16 (q4_K's fragment planes are q4_1's)
    return 4 if fmt_id in SCALED_BY_16 else 2


def side_to_fragment_order(t: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """Row-major side plane [rows, n] (rows % 16 == 0; n * element_size a multiple of entry_bytes) ->
    [rows / 16, n * 16] of the same dtype: tile, entry, then the 16 rows in _SIDE_ROWS order."""
    r = t.shape[0]
    b = t.view(torch.uint8).reshape(r // 16, 16, -1, entry_bytes)
    rows = torch.tensor(_SIDE_ROWS, device=t.device)
    return b[:, rows].permute(0, 2, 1, 3).reshape(r // 16, -1).view(t.dtype)


def side_from_fragment_order(t: torch.Tensor, entry_bytes: int) -> torch.Tensor:
    """The inverse of side_to_fragment_order."""
    tiles = t.shape[0]
    b = t.view(torch.uint8).reshape(tiles, -1, 16, entry_bytes).permute(0, 2, 1, 3)
    out = torch.empty_like(b)
    out[:, torch.tensor(_SIDE_ROWS, device=t.device)] = b
    return out.reshape(tiles * 16, -1).view(t.dtype)


def affine_sides_to_fragment_order(d: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """q4_1's f16 scale and offset planes, row-major [rows, blocks] (rows % 16 == 0, blocks even) -> one f16
    plane [rows / 16, blocks * 32]: per 16-row tile and 64-weight chunk, per lane group g, the 8 values its
    lanes need, (d, m) x (low block, high block) x (row g, row g + 8), in 16 contiguous bytes. One 16-byte
    load per lane and tile instead of four 4-byte ones (side_to_fragment_order's layout, per plane)."""
    r, blocks = d.shape
    both = torch.stack([d, m], dim=-1).view(r // 16, 2, 8, blocks // 2, 2, 2)   # tile, r1, g, chunk, blk, kind
    return both.permute(0, 3, 2, 5, 4, 1).reshape(r // 16, -1)                # tile, chunk, g, kind, blk, r1


def affine_sides_from_fragment_order(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The inverse of affine_sides_to_fragment_order: the row-major (d, m) planes."""
    tiles = t.shape[0]
    both = t.view(tiles, -1, 8, 2, 2, 2).permute(0, 5, 2, 1, 4, 3)               # tile, r1, g, chunk, blk, kind
    both = both.reshape(tiles * 16, -1, 2)
    return both[..., 0].contiguous(), both[..., 1].contiguous()


def _q6_high_words(high: torch.Tensor) -> torch.Tensor:
    """q6_K high bits, values 0..3 [rows, cols] -> int32 words [rows, cols / 16] (bits 2j, 2j + 1: weight j)."""
    shifts = 2 * torch.arange(16, device=high.device, dtype=torch.int64)
    words = (high.reshape(high.shape[0], -1, 16).to(torch.int64) << shifts).sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def _q6_high_values(qh: torch.Tensor) -> torch.Tensor:
    """q6_K high-bit words [rows, cols / 16] (bits 2j, 2j + 1: weight j of each 16) -> values [rows, cols]."""
    shifts = 2 * torch.arange(16, device=qh.device, dtype=torch.int32)
    return ((qh[..., None] >> shifts) & 3).reshape(qh.shape[0], -1).to(torch.uint8)


def fragment_layout(fmt_id: int) -> int:
    """The layout of a format's fragment-order planes (PackedPlanes.fmt_id): q4_K's are q4_1's, q5_K's q5_1's
    (_q4k_as_affine)."""
    return {Q4_K: Q4_1, Q5_K: Q5_1}.get(fmt_id, fmt_id)


def _q4k_as_affine(planes: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """q4_K planes (qs, d = (d, dmin) per super-block, sub = (scale, min) bytes per 32-block) -> q4_1's (q5_K's ->
    q5_1's, their fifth bits as they are):
    an f16 scale d * scale and an f16 offset -dmin * min per 32-block, so w = scale' * q + offset'.

    Why: the GEMV then reads one scale and one offset per block, like q4_1, instead of unpacking 6-bit pairs
    and multiplying by the super-block's (d, dmin) per row and chunk, a dependent chain of ~13 instructions
    in the loop. The products are rounded to f16 once, as that kernel code did. Costs 0.625 bytes per weight
    instead of 0.578 (+8 %)."""
    r = planes["qs"].shape[0]
    d, dmin = planes["d"].float().view(r, -1, 1, 2).unbind(-1)                 # [r, super, 1]
    sc, mn = planes["sub"].view(r, -1, 8, 2).float().unbind(-1)                # [r, super, 8]
    kept = {name: t for name, t in planes.items() if name == "qs" or name == "qh"}     # q5_K's fifth bits stay
    return {**kept, "d": (d * sc).reshape(r, -1).half(), "m": (-(dmin * mn)).reshape(r, -1).half()}


def _fifth_bit_values(qh: torch.Tensor) -> torch.Tensor:
    """Fifth-bit words [rows, cols / 32] (bit j: weight j of the 32-block) -> bits [rows, cols] uint8."""
    shifts = torch.arange(32, device=qh.device, dtype=torch.int32)
    return ((qh[..., None] >> shifts) & 1).reshape(qh.shape[0], -1).to(torch.uint8)


def _fifth_bit_words(bits: torch.Tensor) -> torch.Tensor:
    """The inverse of _fifth_bit_values: bits [rows, cols] -> int32 words [rows, cols / 32]."""
    return _pack_bits_32(bits).view(torch.int32)


# Where the fifth bits of a chunk's low block (its low nibbles) and high block start in their fragment-order byte
FIFTH_BIT = (4, 0)


def fifth_bits_to_fragment_order(qh: torch.Tensor) -> torch.Tensor:
    """The fifth bit of each weight (words [rows, cols / 32], rows % 16 == 0, cols % 64 == 0) -> the plane the
    kernels read beside the fragment-order nibbles: [rows / 16, chunks * 128] bytes, 4 per lane and tile, one
    bit a weight as in the file.

    Lane L = 4 g + c owns qs words j = 0..3 (logical columns k = 8 j + 2 c and k + 1 of rows g and g + 8, low
    nibble the chunk's low block, high nibble its high block). Its byte j holds their fifth bits, the bit of row
    g + 8 r1, column k + e at FIFTH_BIT[block] + 2 e + r1: the low block's at bits 4-7, the high block's at 0-3.
    With the byte in all four bytes of a word, the high half of the word shifted right by 2, the kernel
    (quant_gemv.ASM_NIB5_ZP) finds each f16 half's bits just above the nibbles they belong to (as q6_K's)."""
    bits = _fifth_bit_values(qh)                                   # [R, K], GGUF column order
    r, k = bits.shape
    bits = bits.view(r, k // 32, 32)[..., k_order(Q5_0)]           # logical column order within each block
    b = bits.view(r // 16, 2, 8, k // 64, 2, 4, 4, 2).to(torch.int32)   # tile, r1, g, chunk, block, j, c, e
    byte = sum(b[:, r1, :, :, block, ..., e] << (FIFTH_BIT[block] + 2 * e + r1)
               for r1 in range(2) for block in range(2) for e in range(2))   # [tile, g, chunk, j, c]
    # -> [tile, chunk, g, c, j]: lane 4 g + c, byte j
    return byte.permute(0, 2, 1, 4, 3).reshape(r // 16, -1).to(torch.uint8)


def fifth_bits_from_fragment_order(frag: torch.Tensor) -> torch.Tensor:
    """The inverse of fifth_bits_to_fragment_order: the fifth-bit words [rows, cols / 32]."""
    tiles = frag.shape[0]
    byte = frag.view(tiles, -1, 8, 4, 4).permute(0, 2, 1, 4, 3).to(torch.int32)   # tile, g, chunk, j, c
    b = torch.stack([torch.stack([torch.stack([(byte >> (FIFTH_BIT[block] + 2 * e + r1)) & 1 for e in range(2)], -1)
                                  for block in range(2)], dim=3)
                     for r1 in range(2)], dim=1)                                   # tile, r1, g, chunk, block, j, c, e
    logical = b.reshape(tiles * 16, -1, 32)
    gguf = torch.empty_like(logical)
    gguf[..., k_order(Q5_0)] = logical
    return _fifth_bit_words(gguf.reshape(tiles * 16, -1))


def high_bits_to_fragment_order(qh: torch.Tensor) -> torch.Tensor:
    """q6_K's 2 high bits per weight (words [rows, cols / 16], rows % 16 == 0) -> the plane the Gluon GEMV
    reads beside the fragment-order low nibbles: [rows / 16, chunks * 256] bytes, 8 per lane and tile.

    Lane L = 4 g + c owns qs words j = 0..3, each holding logical columns k = 8 j + 2 c and k + 1 of rows
    g and g + 8 (in q6_K's k_order), low nibble = the chunk's low block, high nibble = its high block.
    Its byte 2 j + e (e = 0, 1: column k + e) holds their high bits: bits 4-5 (row g, low block),
    6-7 (g + 8, low), 0-1 (g, high), 2-3 (g + 8, high). The kernel duplicates each byte into a word of the
    qs word's shape, where a mask puts every bit pair just above its nibble."""
    high = _q6_high_values(qh)                                # [R, K]
    r, k = high.shape
    high = high.view(r, k // 32, 32)[..., k_order(Q6_K)]      # logical column order
    h = high.view(r // 16, 2, 8, k // 64, 2, 4, 4, 2).to(torch.int32)   # tile, half, g, chunk, block, j, c, e
    byte = (h[:, 0, :, :, 0] << 4) | (h[:, 1, :, :, 0] << 6) | h[:, 0, :, :, 1] | (h[:, 1, :, :, 1] << 2)
    # [tile, g, chunk, j, c, e] -> [tile, chunk, g, c, j, e]: lane 4 g + c, byte 2 j + e
    return byte.permute(0, 2, 1, 4, 3, 5).reshape(r // 16, -1).to(torch.uint8)


def high_bits_from_fragment_order(frag: torch.Tensor) -> torch.Tensor:
    """The inverse of high_bits_to_fragment_order: the q6_K high-bit words [rows, cols / 16]."""
    tiles = frag.shape[0]
    b = frag.view(tiles, -1, 8, 4, 4, 2).permute(0, 2, 1, 4, 3, 5).to(torch.int32)   # tile, g, chunk, j, c, e
    parts = [[(b >> 4) & 3, b & 3], [(b >> 6) & 3, (b >> 2) & 3]]                  # [half][block]
    high = torch.stack([torch.stack(parts[half], dim=3) for half in range(2)], dim=1)  # tile, half, g, chunk, ...
    logical = high.reshape(tiles * 16, -1, 32)
    gguf = torch.empty_like(logical)
    gguf[..., k_order(Q6_K)] = logical
    return _q6_high_words(gguf.reshape(tiles * 16, -1))


def pack_planes(fmt: QuantFormat, rows: int, cols: int, raw: torch.Tensor, device: torch.device,
                fragment: bool = False, row_scale: torch.Tensor | None = None) -> PackedPlanes:
    """GGUF bytes uint8 [rows, row_bytes] (any device, may be a read-only mmap) -> planes on `device`.
    fragment: qs and side planes in fragment order (only for FRAGMENT_FORMATS). row_scale: the checkpoint
    formats' [rows] (FP8's must be fp8_packable)."""
    fmt_id = PACKED_FORMATS[fmt.name]
    assert not fragment or fmt_id in FRAGMENT_FORMATS, fmt.name
    assert (row_scale is not None) == (fmt_id in ROW_SCALED), "a checkpoint format's planes carry its row scale"
    rows_pad, cols_pad = _round_up(rows, ROW_PAD), _round_up(cols, COL_PAD)
    padded_row_bytes = fmt.row_bytes(cols_pad)
    planes: dict[str, torch.Tensor] = {}
    for r0 in range(0, rows_pad, _ROWS_PER_CHUNK):
        r1 = min(rows_pad, r0 + _ROWS_PER_CHUNK)
        chunk = torch.zeros(r1 - r0, padded_row_bytes, dtype=torch.uint8, device=device)
        if r0 < rows:  # zero bytes decode to 0 in every format (the f16 scales are +0.0)
            chunk[:min(rows, r1) - r0, :raw.shape[1]] = raw[r0:min(rows, r1)].to(device)
        scale = None
        if row_scale is not None:   # padded rows get scale 0
            scale = torch.zeros(r1 - r0, dtype=torch.float32, device=device)
            scale[:max(0, min(rows, r1) - r0)] = row_scale[r0:min(rows, r1)].to(device, torch.float32)
        chunk_planes = _pack_chunk(fmt_id, chunk, cols_pad, scale)
        if fragment and fmt_id in (Q4_K, Q5_K):
            chunk_planes = _q4k_as_affine(chunk_planes)
        if fragment and "m" in chunk_planes:      # q4_1's layout: scales and offsets in one plane
            chunk_planes["d"] = affine_sides_to_fragment_order(chunk_planes["d"], chunk_planes.pop("m"))
        for name, t in chunk_planes.items():
            if fragment:
                if name == "d" and fmt_id in AFFINE_FORMATS:
                    pass                                # already in fragment order
                elif name == "qs":
                    t = to_fragment_order(t, fmt_id)
                    if fmt_id in DECODE_SLOTS:
                        t = to_decode_order(t, fmt_id)
                elif name == "qh":
                    t = (fifth_bits_to_fragment_order(t) if fmt_id in FIFTH_BIT_FORMATS
                         else high_bits_to_fragment_order(t))
                else:
                    t = side_to_fragment_order(t, _side_entry_bytes(fmt_id))
                if name not in planes:
                    planes[name] = torch.empty(rows_pad // 16, t.shape[1], dtype=t.dtype, device=device)
                planes[name][r0 // 16:r1 // 16] = t
                continue
            if name not in planes:
                planes[name] = torch.empty(rows_pad, t.shape[1], dtype=t.dtype, device=device)
            planes[name][r0:r1] = t
    layout = fragment_layout(fmt_id) if fragment else fmt_id
    return PackedPlanes(layout, rows, cols, rows_pad, cols_pad, **planes, fragment=fragment)


def unpack_planes(p: PackedPlanes) -> torch.Tensor:
    """Torch decode of the planes -> float32 [rows, cols]: checks the repack against formats.dequantize."""
    R, K = p.rows_pad, p.cols_pad
    if p.fragment:
        if p.fmt_id in AFFINE_FORMATS:
            d, m = affine_sides_from_fragment_order(p.d)
        else:
            d, m = (None if t is None else side_from_fragment_order(t, _side_entry_bytes(p.fmt_id)) for t in (p.d, p.m))
        qs = from_decode_order(p.qs, p.fmt_id) if p.fmt_id in DECODE_SLOTS else p.qs
        p = PackedPlanes(p.fmt_id, p.rows, p.cols, R, K, from_fragment_order(qs, p.fmt_id), d, m,
                         None if p.sub is None else side_from_fragment_order(p.sub, _side_entry_bytes(p.fmt_id)),
                         qh=None if p.qh is None else (fifth_bits_from_fragment_order(p.qh)
                                                       if p.fmt_id in FIFTH_BIT_FORMATS
                                                       else high_bits_from_fragment_order(p.qh)))
    qs = p.qs
    if p.fmt_id == FP8_E4M3:
        w = qs.view(torch.float8_e4m3fn).float().view(R, K // 32, 32) * (p.d.float()[..., None] / FP8_D_SCALE)
    elif p.fmt_id == NVFP4:
        v = qs.view(R, K // 64, 1, 32)
        codes = torch.cat([v & 15, v >> 4], dim=2).reshape(R, K).long()
        grid = torch.tensor(E2M1_VALUES, device=qs.device)
        values = torch.where(codes >= 8, -grid[codes & 7], grid[codes & 7]).view(R, K // 16, 16)
        w = values * p.sub.view(torch.float8_e4m3fn).float()[..., None] * p.d.float()[..., None]
    elif p.fmt_id == Q8_0:
        q = qs.view(torch.int8).float().view(R, K // 32, 32)
        w = q * p.d.float()[..., None]
    else:
        v = qs.view(R, K // 64, 1, 32)
        nib = torch.cat([v & 15, v >> 4], dim=2).reshape(R, K).float()   # weight order
        if p.fmt_id == Q6_K:
            high = _q6_high_values(p.qh).float()
            q = (nib + 16 * high - 32).view(R, K // 16, 16)
            w = (p.d.repeat_interleave(16, dim=1) * p.sub.float())[..., None] * q
        else:
            q = nib.view(R, K // 32, 32)
            if p.fmt_id in FIFTH_BIT_FORMATS:
                q = q + 16 * _fifth_bit_values(p.qh).float().view(R, K // 32, 32)
            if p.fmt_id in (Q4_K, Q5_K):
                d, dmin = p.d.float().view(R, K // 256, 2).repeat_interleave(8, dim=1).unbind(-1)
                sc, mn = p.sub.float().view(R, K // 32, 2).unbind(-1)
                w = (d * sc)[..., None] * q - (dmin * mn)[..., None]
            elif p.fmt_id in AFFINE_FORMATS:
                w = p.d.float()[..., None] * q + p.m.float()[..., None]
            else:
                w = p.d.float()[..., None] * (q - (16 if p.fmt_id == Q5_0 else 8))
    return w.reshape(R, K)[:p.rows, :p.cols]


def fp8_packable(row_scale: torch.Tensor) -> bool:
    """Do an FP8 weight's row scales, and those times FP8_D_SCALE, fit q8_0's f16 d as normal numbers (else it runs
    dequantized, as formats without planes do)? Scales amax / 448 of real weights, per channel or per tensor, are
    about 1e-4 .. 1e-2."""
    a = row_scale.abs()
    return bool(((a == 0) | ((a >= 2.0 ** -14) & (a <= 65504.0 / FP8_D_SCALE))).all())


def packable(fmt_name: str) -> bool:
    return format_of(fmt_name).name in PACKED_FORMATS


def weight_packable(fmt_name: str, row_scale: torch.Tensor | None) -> bool:
    """Can a weight of this format (and row scale) go into planes? Its format has them, and an FP8 weight's scales
    fit q8_0's f16 d (fp8_packable); else it runs as a dense matrix."""
    fmt_id = PACKED_FORMATS.get(fmt_name)
    return fmt_id is not None and (fmt_id != FP8_E4M3 or fp8_packable(row_scale))
