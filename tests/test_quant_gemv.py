"""The Gluon narrow GEMV (quant_gemv.py) and its fragment-order repack.

The repack runs on the CPU (CI): it must be a byte permutation that decodes to the GGUF values and
that puts, for every lane, the bytes of its mma.sync m16n8k16 A fragment where the kernel's dequant
expects them (checked against the fragment table of the PTX ISA, written out independently below).
The kernel itself needs CUDA (Gluon has no interpreter): checked against the float64 reference on
odd shapes, every config knob, batch invariance, and CUDA-graph replay.
"""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

from cobatch.kernels import matmul_plans, packed_weight
from cobatch.kernels import quant_gemm, quant_gemv, quant_pack
from cobatch.kernels import quant_matmul as qm
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.kernels.quant_gemm import GemmConfig
from cobatch.kernels.quant_gemv import GemvConfig, GemvPlan
from cobatch.kernels.quant_pack import (fragment_order, from_fragment_order, pack_planes,
                                        side_from_fragment_order, side_to_fragment_order, to_fragment_order,
                                        unpack_planes)
from cobatch.quant.formats import E2M1_VALUES, dequantize, format_of, random_quantized
from cobatch.quant.weight import QuantWeight
from cobatch.testing.hf_checkpoints import checkpoint_weight

from conftest import requires_cuda, requires_hopper
from kernel_checks import assert_graph_replay_matches, poisoned, relative_error

FRAGMENT = ["q8_0", "q4_0", "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", "fp8_e4m3", "nvfp4"]
K_QUANTS = ("q4_k", "q5_k", "q6_k")    # rows of whole 256-weight super-blocks


def make_weight(fmt_name: str, rows: int, cols: int, seed: int, device="cpu") -> QuantWeight:
    fmt = format_of(fmt_name)
    if fmt.ggml_type is None:    # FP8: a normal matrix as its checkpoint holds it (e4m3 values, a scale a channel)
        w = checkpoint_weight(torch.randn(rows, cols, generator=torch.Generator().manual_seed(seed)) * 0.02, fmt_name)
        return QuantWeight(fmt, rows, cols, w.raw.to(device), w.row_scale.to(device))
    parts = [random_quantized(fmt.ggml_type, min(1024, rows - r0), cols, torch.Generator().manual_seed(seed + r0))
             for r0 in range(0, rows, 1024)]
    return QuantWeight(fmt, rows, cols, torch.cat(parts).to(device))


def planes_of(w: QuantWeight, device="cpu", fragment: bool = True):
    return pack_planes(w.fmt, w.rows, w.cols, w.raw, torch.device(device), fragment=fragment, row_scale=w.row_scale)


def planes_values(w: QuantWeight) -> torch.Tensor:
    """The float32 values the planes must decode to: the format's own decode (FP8's row scale as the f16 d of
    q8_0's planes; NVFP4's stays f32)."""
    if w.row_scale is not None:
        scale = w.row_scale.half().float() if w.fmt.name == "fp8_e4m3" else w.row_scale
        return QuantWeight(w.fmt, w.rows, w.cols, w.raw, scale).dequantize(torch.float32).cpu()
    return dequantize(w.raw.cpu(), w.fmt.ggml_type, w.cols)


# --- repack (CPU) -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("fmt_id", [quant_pack.Q8_0, quant_pack.Q6_K])
def test_fragment_order_is_a_permutation_and_inverts(fmt_id):
    assert sorted(fragment_order(fmt_id).tolist()) == list(range(512))
    qs = torch.randint(0, 256, (48, 7 * 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    frag = to_fragment_order(qs, fmt_id)
    assert frag.shape == (3, 7 * 512)
    assert torch.equal(from_fragment_order(frag, fmt_id), qs)


@pytest.mark.parametrize("fmt_id", [quant_pack.Q8_0, quant_pack.Q4_1, quant_pack.Q6_K, quant_pack.NVFP4])
def test_k_order_gives_each_lane_contiguous_activations(fmt_id):
    """PTX ISA, mma.m16n8k16 .f16 B fragment: lane = 4 g + c holds b0..b3 at row (k) = 2 c + (i % 2) +
    8 (i // 2), column (token) g; the second k16 half of a 32-column tile adds 16. Through k_order those
    8 logical columns must be 8 contiguous GGUF columns (one 16-byte load of x per lane and token), or for
    q6_K and NVFP4 4 contiguous columns per k16 half that stay in their half (their scales change every 16
    weights)."""
    order = quant_pack.k_order(fmt_id)
    assert sorted(order) == list(range(32))
    for c in range(4):
        for half in range(2):
            cols = sorted(order[16 * half + 2 * c + (i % 2) + 8 * (i // 2)] for i in range(4))
            if fmt_id in (quant_pack.Q6_K, quant_pack.NVFP4):
                assert cols == list(range(16 * half + 4 * c, 16 * half + 4 * c + 4)), (c, half)
        if fmt_id not in (quant_pack.Q6_K, quant_pack.NVFP4):
            cols = sorted(order[16 * half + 2 * c + (i % 2) + 8 * (i // 2)] for half in range(2) for i in range(4))
            assert cols == list(range(8 * c, 8 * c + 8)), c


@pytest.mark.parametrize("fmt_id", [quant_pack.Q8_0, quant_pack.Q6_K, quant_pack.NVFP4])
def test_fragment_order_matches_the_ptx_a_fragment(fmt_id):
    """PTX ISA, mma.m16n8k16 .f16 A fragment: lane = 4 g + c holds a0..a7 at
    row = g + 8 * ((i // 2) % 2), col = 2 c + (i % 2) + 8 * (i // 4); registers pair (a0, a1), (a2, a3), ...
    For a 16 x 32 tile, the second k16 half adds 16 to col (a8..a15). The kernel reads 32-bit word j of a
    lane and takes bytes (0, 2) as register pair 2 j's elements and bytes (1, 3) as the next register's.
    `col` is the logical column; the byte there is GGUF column k_order[col]."""
    order = fragment_order(fmt_id).view(32, 4, 4)            # lane, word, byte -> row * 32 + GGUF col
    k_order = quant_pack.k_order(fmt_id)
    for lane in range(32):
        g, c = divmod(lane, 4)
        for word in range(4):
            half, reg_pair = divmod(word, 2)                  # word j: k16 half j // 2, registers a[4(j%2)..]
            for first_byte, reg in ((0, 2 * reg_pair), (1, 2 * reg_pair + 1)):
                for elem, byte in enumerate((first_byte, first_byte + 2)):
                    i = 2 * reg + elem                        # a_i within the k16 half
                    row = g + 8 * ((i // 2) % 2)
                    col = 16 * half + 2 * c + (i % 2) + 8 * (i // 4)
                    assert order[lane, word, byte].item() == row * 32 + k_order[col], (lane, word, byte)


@pytest.mark.parametrize("entry_bytes", [2, 4])
def test_side_planes_put_a_lanes_two_rows_side_by_side(entry_bytes):
    """Lane group g of an mma.sync fragment holds rows g and g + 8 of each 16-row tile: in the fragment
    side order those two rows' entries are adjacent, entry after entry, tile after tile."""
    rows, entries = 48, 5
    gen = torch.Generator().manual_seed(4)
    plane = torch.randint(0, 256, (rows, entries * entry_bytes), generator=gen, dtype=torch.uint8)
    frag = side_to_fragment_order(plane, entry_bytes)
    assert frag.shape == (rows // 16, entries * 16 * entry_bytes)
    pieces = frag.reshape(rows // 16, entries, 8, 2, entry_bytes)        # tile, entry, g, (g | g + 8)
    for tile in range(rows // 16):
        for e in range(entries):
            for g in range(8):
                for half in range(2):
                    row = 16 * tile + g + 8 * half
                    expected = plane[row, e * entry_bytes:(e + 1) * entry_bytes]
                    assert torch.equal(pieces[tile, e, g, half], expected), (tile, e, g, half)
    assert torch.equal(side_from_fragment_order(frag, entry_bytes), plane)


def test_affine_side_plane_gives_a_lane_group_its_eight_values_in_16_bytes():
    """q4_1's (d, m) in fragment order: per tile, chunk and lane group g, the values of (d, m) x (low block,
    high block) x (row g, row g + 8), in that order, 8 f16 side by side."""
    rows, blocks = 32, 6
    gen = torch.Generator().manual_seed(5)
    d, m = (torch.randn(rows, blocks, generator=gen).half() for _ in range(2))
    frag = quant_pack.affine_sides_to_fragment_order(d, m)
    assert frag.shape == (rows // 16, blocks * 32)
    pieces = frag.view(rows // 16, blocks // 2, 8, 2, 2, 2)       # tile, chunk, g, kind, block, r1
    for tile in range(rows // 16):
        for chunk in range(blocks // 2):
            for g in range(8):
                for kind, plane in enumerate((d, m)):
                    for block in range(2):
                        for r1 in range(2):
                            want = plane[16 * tile + 8 * r1 + g, 2 * chunk + block]
                            assert pieces[tile, chunk, g, kind, block, r1] == want, (tile, chunk, g, kind, block, r1)
    back = quant_pack.affine_sides_from_fragment_order(frag)
    assert torch.equal(back[0], d) and torch.equal(back[1], m)


@pytest.mark.parametrize("fmt_name", FRAGMENT)
def test_fragment_planes_decode_to_the_gguf_values(fmt_name):
    rows, cols = 40, 512
    w = make_weight(fmt_name, rows, cols, seed=1)
    planes = planes_of(w)
    assert planes.fragment and planes.qs.shape[0] == planes.rows_pad // 16
    row_major = planes_of(w, fragment=False)
    ref = planes_values(w)
    if fmt_name in ("q4_k", "q5_k"):   # as q4_1 / q5_1: an f16 scale and offset per 32-block, each rounded once
        fifth = fmt_name == "q5_k"
        assert planes.fmt_id == (quant_pack.Q5_1 if fifth else quant_pack.Q4_1)
        assert planes.m is None and planes.sub is None   # m inside d
        assert planes.nbytes == planes.rows_pad * planes.cols_pad * (5 + fifth) // 8    # 4 (5) bits + 2 x f16 per 32
        assert relative_error(unpack_planes(planes), ref) < 1e-3
        return
    assert planes.nbytes == row_major.nbytes
    torch.testing.assert_close(unpack_planes(planes), ref, rtol=0, atol=0)


@pytest.mark.parametrize("fmt_name", FRAGMENT)
def test_row_tiles_of_a_stack_are_each_part_packed_alone(fmt_name):
    """Stacked MoE experts (kernels/packed_experts.py): packing 3 experts of 128 rows as one matrix and taking
    expert e's row tiles gives the planes of expert e packed alone, byte for byte."""
    rows, cols = 128, 512
    w = make_weight(fmt_name, 3 * rows, cols, seed=4)
    stack = planes_of(w)
    for e in range(3):
        view = stack.row_tiles(e * rows // 16, (e + 1) * rows // 16)
        alone = planes_of(w.row_slice(e * rows, (e + 1) * rows))
        assert (view.rows, view.rows_pad, view.fmt_id) == (alone.rows, alone.rows_pad, alone.fmt_id)
        assert len(view.tensors()) == len(alone.tensors())
        assert all(torch.equal(a, b) for a, b in zip(view.tensors(), alone.tensors()))


@pytest.mark.parametrize("fmt_name", FRAGMENT)
def test_dequantize_kernel_reads_fragment_order(fmt_name):
    """The prefill path's dequantize kernel (Triton: interpreted on the CPU, compiled on a GPU) gathers
    fragment-order bytes. K not a multiple of 256 where the format allows it."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows, cols = 40, 768 if fmt_name not in K_QUANTS else 512
    w = make_weight(fmt_name, rows, cols, seed=2)
    planes = planes_of(w, device)
    ref = planes_values(w)
    if device == "cpu":       # the interpreter computes in f32; q4_K's block scales are f16 (_q4k_as_affine)
        dense = torch.full((rows, cols), float("nan"), dtype=torch.float32)
        qm.dequantize_planes(planes, dense)
        if fmt_name in ("q4_k", "q5_k"):
            torch.testing.assert_close(dense, unpack_planes(planes), rtol=1e-6, atol=1e-7)
            assert relative_error(dense, ref) < 1e-3
        else:
            torch.testing.assert_close(dense, ref, rtol=1e-6, atol=1e-7)
    else:                     # the compiled kernel's packed-f16 dequant rounds once or twice
        dense = torch.full((rows, cols), float("nan"), dtype=torch.float16, device=device)
        qm.dequantize_planes(planes, dense)
        assert relative_error(dense.cpu(), ref) < 2e-3


def _f16x2(word: int) -> np.ndarray:
    return np.array([word & 0xFFFF, word >> 16], dtype=np.uint16).view(np.float16)


def _word(halves: np.ndarray) -> int:
    lo, hi = halves.astype(np.float16).view(np.uint16).tolist()
    return lo | (hi << 16)


def run_ptx_bit_ops(asm: str, inputs: dict[str, int]) -> dict[str, int]:
    """Run the lines of an inline-PTX block on 32-bit words, registers by name: the integer ones (shl, shr, and, or,
    mul.lo, mov, a word's halves into two registers, prmt without sign modes, lop3 with 0xEA = (a & b) | c) exactly,
    sub.rn.f16x2 and mul.rn.f16x2 in numpy's float16 (each half rounded once, as the instruction does)."""
    regs = dict(inputs)
    value = (lambda t: regs[t] if t in regs else int(t, 0))
    for line in asm.strip().strip("{}").splitlines():
        line = line.strip().rstrip(";")
        if not line or line.startswith(".reg"):
            continue
        op, args = line.split(None, 1)
        dst, *src = [a.strip() for a in args.split(",")]
        if dst.startswith("{"):         # mov.b32 {lo, hi}, word: its two 16-bit halves
            assert op == "mov.b32", line
            lo, hi = dst.strip("{ "), src[0].strip("} ")
            word = value(src[1])
            regs[lo], regs[hi] = word & 0xFFFF, word >> 16
            continue
        a = [value(t) for t in src]
        if op == "shl.b32":
            regs[dst] = (a[0] << a[1]) & 0xFFFFFFFF
        elif op in ("shr.b32", "shr.u32"):
            regs[dst] = a[0] >> a[1]
        elif op == "and.b32":
            regs[dst] = a[0] & a[1]
        elif op == "or.b32":
            regs[dst] = a[0] | a[1]
        elif op == "mul.lo.u32":
            regs[dst] = (a[0] * a[1]) & 0xFFFFFFFF
        elif op == "lop3.b32" and a[3] == 0xEA:
            regs[dst] = (a[0] & a[1]) | a[2]
        elif op == "mov.b32":
            regs[dst] = a[0]
        elif op == "prmt.b32":     # byte i of the result: byte (selector nibble i) of {a[1], a[0]}
            both = a[0] | (a[1] << 32)
            regs[dst] = sum(((both >> (8 * ((a[2] >> (4 * i)) & 7))) & 255) << (8 * i) for i in range(4))
        elif op == "sub.rn.f16x2":
            regs[dst] = _word(_f16x2(a[0]) - _f16x2(a[1]))
        elif op == "mul.rn.f16x2":
            regs[dst] = _word(_f16x2(a[0]) * _f16x2(a[1]))
        elif op == "fma.rn.f16x2":    # one rounding: the float32 product of two f16 is exact
            regs[dst] = _word(_f16x2(a[0]).astype(np.float32) * _f16x2(a[1]).astype(np.float32)
                              + _f16x2(a[2]).astype(np.float32))
        else:
            raise AssertionError(f"not emulated: {line}")
    return regs


def decode_order_word(word: int, fmt_id: int) -> int:
    """A fragment-order qs word (bytes 0..3 low to high) as pack_planes stores it for FP8 and NVFP4."""
    frag = torch.tensor([(word >> s) & 255 for s in (0, 8, 16, 24)], dtype=torch.uint8)
    stored = quant_pack.to_decode_order(frag, fmt_id)
    return sum(int(b) << (8 * i) for i, b in enumerate(stored))


@pytest.mark.parametrize("fmt_name", ["fp8_e4m3", "nvfp4"])
def test_decode_order_moves_every_bit_of_a_word_once_and_inverts(fmt_name):
    fmt_id = quant_pack.PACKED_FORMATS[fmt_name]
    moved = [decode_order_word(1 << bit, fmt_id) for bit in range(32)]
    assert all(m and m & (m - 1) == 0 for m in moved) and sorted(moved) == [1 << b for b in range(32)]
    frag = torch.randint(0, 256, (3, 1024), generator=torch.Generator().manual_seed(9), dtype=torch.int32)
    frag = frag.to(torch.uint8)
    assert torch.equal(quant_pack.from_decode_order(quant_pack.to_decode_order(frag, fmt_id), fmt_id), frag)


def test_the_nvfp4_decode_reads_every_code_as_its_value_times_2_to_the_minus_14():
    """quant_gemv.ASM_FP4 (run on the CPU by the emulator above) on a fragment-order qs word put in decode order
    (quant_pack.to_decode_order, as pack_planes stores NVFP4): for every e2m1 code in every nibble, the f16 it
    leaves is the code's value (sign, then 0, 0.5, 1, 1.5, 2, 3, 4, 6) times 2^-14 exactly, at the lane the A
    fragment gives it: $0 the low nibbles of bytes 0 and 2 (row g, low block), $1 those of bytes 1 and 3
    (row g + 8), $2 and $3 the high nibbles."""
    asm = quant_gemv.ASM_FP4.value if hasattr(quant_gemv.ASM_FP4, "value") else quant_gemv.ASM_FP4
    want = {c: (-1 if c >= 8 else 1) * E2M1_VALUES[c & 7] * 2.0 ** -14 for c in range(16)}
    gen = torch.Generator().manual_seed(21)
    words = [sum(c << (4 * i) for i in range(8)) for c in range(16)]   # each code in every nibble
    words += torch.randint(0, 2 ** 32, (64,), generator=gen, dtype=torch.int64).tolist()
    one = 0x3C003C00
    for w in words:
        out = run_ptx_bit_ops(asm, {"$4": decode_order_word(w, quant_pack.NVFP4), "$5": one, "$6": one, "$7": one,
                                    "$8": one})
        nib = [(w >> (4 * i)) & 15 for i in range(8)]     # byte b's low nibble is nib[2 b], its high nib[2 b + 1]
        for reg, (lane0, lane1) in {"$0": (0, 4), "$1": (2, 6), "$2": (1, 5), "$3": (3, 7)}.items():
            halves = np.array([out[reg] & 0xFFFF, out[reg] >> 16], dtype=np.uint16).view(np.float16)
            assert halves.tolist() == [want[nib[lane0]], want[nib[lane1]]], (hex(w), reg)


def test_nvfp4_scales_by_bit_moves_read_every_e4m3_byte_as_its_value():
    """quant_gemv.ASM_FP4_SCALES_BITS (the GEMV's NVFP4 scales where cvt has no e4m3: an A100), run on the CPU by
    the emulator above: each of the 254 e4m3 bytes that are numbers, in each byte of the word, leaves torch's e4m3
    value as an f16, exactly ($0..$3: bytes 0..3), as ASM_FP4_SCALES' cvts do."""
    asm = quant_gemv.ASM_FP4_SCALES_BITS
    asm = asm.value if hasattr(asm, "value") else asm
    values = [b for b in range(256) if b & 0x7F != 0x7F]
    want = torch.tensor(values, dtype=torch.uint8).view(torch.float8_e4m3fn).float().tolist()
    for pos in range(4):
        for b, value in zip(values, want):
            filler = [0x38, 0xB8, 0x01, 0x7E]           # 1, -1, the smallest subnormal, 448 around it
            word = sum((b if i == pos else filler[i]) << (8 * i) for i in range(4))
            out = run_ptx_bit_ops(asm, {"$4": word})
            got = [float(np.array([out[f"${i}"]], dtype=np.uint16).view(np.float16)[0]) for i in range(4)]
            expect = [value if i == pos else (1.0, -1.0, 2.0 ** -9, 448.0)[i] for i in range(4)]
            assert got == expect, (pos, hex(b), got, expect)


def test_the_fp8_decode_reads_every_e4m3_byte_as_its_value_times_2_to_the_minus_8():
    """quant_gemv.ASM_FP8 (run on the CPU by the emulator above) on a fragment-order word put in decode order
    (quant_pack.to_decode_order, as pack_planes stores FP8): each of the 254 e4m3 bytes that are numbers, in each
    byte of the word, leaves an f16 that is torch's e4m3 value times 2^-8 exactly (subnormals and -0 included) at
    the lane its pairing gives it ($0: bytes 0 and 2, $1: bytes 1 and 3, low byte in the low half), and 0 in the
    other lane; the 2^8 is in FP8's d (quant_pack.FP8_D_SCALE)."""
    asm = quant_gemv.ASM_FP8.value if hasattr(quant_gemv.ASM_FP8, "value") else quant_gemv.ASM_FP8
    assert quant_pack.FP8_D_SCALE == 2.0 ** 8
    codes = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    want = (codes.view(torch.float8_e4m3fn).float() * 2.0 ** -8).half().view(torch.int16).tolist()
    one = 0x3C003C00
    for code, bits in zip(codes.tolist(), want):
        for byte, (reg, half) in enumerate((("$0", 0), ("$1", 0), ("$0", 1), ("$1", 1))):
            out = run_ptx_bit_ops(asm, {"$2": decode_order_word(code << (8 * byte), quant_pack.FP8_E4M3), "$3": one,
                                        "$4": one})
            got = out[reg] >> (16 * half) & 0xFFFF
            assert got == bits & 0xFFFF and out[reg] >> (16 * (1 - half)) & 0xFFFF == 0, (hex(code), byte)


@pytest.mark.parametrize("fmt_name", ["q5_0", "q5_1"])
def test_the_fifth_bit_decode_reads_each_packed_weight_as_its_gguf_value(fmt_name):
    """quant_gemv.ASM_NIB5_ZP (q5_0) and ASM_NIB5_AFFINE (q5_1), run on the CPU by the emulator above, on the words
    pack_planes stores for a random weight: for every tile, lane and qs word, given its fifth-bit byte in all four
    bytes (quant_gemv._fifth_bits), scales 1 and 1/16 (and offsets 0), each weight's q (minus q5_0's offset 16) as
    the GGUF bytes hold it (nibble, fifth bit), at the lane the A fragment gives it: $0 (row g) and $1 (g + 8) the
    low block, $2 and $3 the high block, half e of each register column k + e."""
    asm = quant_gemv.ASM_NIB5_ZP if fmt_name == "q5_0" else quant_gemv.ASM_NIB5_AFFINE
    asm = asm.value if hasattr(asm, "value") else asm
    rows, cols = 32, 128
    w = make_weight(fmt_name, rows, cols, seed=23)
    size = 22 if fmt_name == "q5_0" else 24
    blocks = w.raw.view(rows, cols // 32, size)
    qh = blocks[..., size - 20:size - 16].contiguous().view(torch.int32)                   # [rows, blocks, 1]
    nib = torch.cat([blocks[..., size - 16:] & 15, blocks[..., size - 16:] >> 4], dim=-1)  # GGUF: byte j = j, j + 16
    q = (nib.int() + 16 * ((qh >> torch.arange(32)) & 1)).reshape(rows, cols) - (16 if fmt_name == "q5_0" else 0)
    assert ((q < 0) if fmt_name == "q5_0" else (q >= 16)).any()                        # the fifth bit in use
    p = planes_of(w)
    order = quant_pack.k_order(quant_pack.Q5_0)
    one, sixteenth = 0x3C003C00, 0x2C002C00
    regs = {"$6": one, "$7": one, "$8": sixteenth, "$9": sixteenth, "$10": 0, "$11": 0, "$12": 0, "$13": 0}
    for tile in range(rows // 16):
        for chunk in range(cols // 64):
            for lane in range(32):
                g, c = lane // 4, lane % 4
                for j in range(4):
                    at = chunk * 512 + 16 * lane + 4 * j
                    word = sum(int(p.qs[tile, at + i]) << (8 * i) for i in range(4))
                    h = int(p.qh[tile, chunk * 128 + 4 * lane + j]) * 0x01010101
                    out = run_ptx_bit_ops(asm, {"$4": word, "$5": h, **regs})
                    for reg, (r1, block) in {"$0": (0, 0), "$1": (1, 0), "$2": (0, 1), "$3": (1, 1)}.items():
                        row = 16 * tile + 8 * r1 + g
                        cols_e = [64 * chunk + 32 * block + order[8 * j + 2 * c + e] for e in range(2)]
                        want = [float(q[row, col]) for col in cols_e]
                        assert _f16x2(out[reg]).tolist() == want, (tile, chunk, lane, j, reg)


def test_default_config_divides_k_and_fills_the_gpu():
    for rows_pad, n_chunks in [(4096, 64), (4096, 128), (6144, 64), (28672, 64), (4096, 224), (128256, 128),
                               (1024, 16), (896, 20), (4864, 16), (2048, 44), (2048, 48), (2048, 88)]:
        cfg = matmul_plans.default_gemv_config("q4_k", rows_pad, n_chunks)
        assert n_chunks % (cfg.W * cfg.split_k * cfg.U) == 0, (rows_pad, n_chunks, cfg)
        if (rows_pad >= 4096 and n_chunks >= 64) or rows_pad == 2048:
            assert (rows_pad // cfg.rows_per_cta()) * cfg.split_k >= 2 * 132, (rows_pad, n_chunks, cfg)
    # K splits by any divisor of the warps' chunks, not only powers of two (DeepSeek-V2-Lite's shared down: 44
    # chunks, which doubling left at one split: 32 CTAs)
    assert matmul_plans.default_gemv_config("q4_k", 2048, 44).split_k == 11
    # a warp's loads run ahead up to 4 K steps where its steps divide (or `most`)
    assert [matmul_plans.loads_ahead(s) for s in (1, 2, 3, 6, 8, 12)] == [1, 2, 1, 2, 4, 4]
    assert [matmul_plans.loads_ahead(s, most=16) for s in (7, 28, 32, 112, 148)] == [1, 4, 16, 16, 4]


def test_deep_default_config_keeps_k_whole_where_the_rows_fill_the_gpu(monkeypatch):
    """One row tile a warp; K split only where the 16-row CTAs are fewer than the SMs, by the fewest divisor that
    leaves each warp a multiple of 4 K steps; the loads up to 16 K steps ahead, dividing the warp's steps (the rule
    under the tails and the wide CTAs, which the next two tests add)."""
    monkeypatch.setattr(matmul_plans, "GEMV_TAILS", False)
    monkeypatch.setattr(matmul_plans, "DEEP_GEMV_WIDE_LONG_K", False)
    cases = {  # (rows_pad, chunks): (split_k, U)
        (4608, 112): (1, 4),      # Qwen2.5-7B q8_0 qkv: 288 CTAs, 28 steps a warp (the split default: 4 ways, U 1)
        (3584, 592): (1, 4),      # its down: 148 steps a warp (the split default: 4 ways, 37 steps, U 1)
        (4096, 128): (1, 16),     # Llama-3-8B q8_0 o
        (512, 128): (8, 4),       # 32 CTAs: split to 8 ways, 4 steps each
        (1024, 56): (7, 2),       # 64 CTAs, 14 steps: 7 ways (no split leaves a multiple of 4; the fewest that fills)
    }
    for (rows_pad, n_chunks), (split, u) in cases.items():
        cfg = matmul_plans.deep_gemv_config(rows_pad, n_chunks)
        assert (cfg.W, cfg.RT, cfg.split_k, cfg.U, cfg.R) == (4, 1, split, u, 128), (rows_pad, n_chunks, cfg)
        assert n_chunks % (cfg.W * cfg.split_k * cfg.U) == 0


def test_with_tails_the_deep_default_runs_16_steps_ahead_whatever_a_warps_step_count(monkeypatch):
    """GEMV_TAILS: U is the largest power of two up to 16 and the warp's steps (the rest runs as the kernel's tail),
    where without it U divides the steps: Qwen2.5-7B's q4_K qkv (56 chunks, 14 steps a warp) ran at U = 2."""
    tailed = [matmul_plans.loads_ahead(s, most=16, tail=True) for s in (1, 2, 3, 7, 14, 28, 74, 148)]
    assert tailed == [1, 2, 2, 4, 8, 16, 16, 16]
    cases = {(4608, 56): (1, 2, 8), (3584, 296): (1, 2, 16), (4608, 112): (1, 4, 16), (1024, 56): (7, 2, 2)}
    monkeypatch.setattr(matmul_plans, "DEEP_GEMV_WIDE_LONG_K", False)    # 4 warps, whose step counts these are
    for (rows_pad, n_chunks), (split, u_divisor, u_tail) in cases.items():
        monkeypatch.setattr(matmul_plans, "GEMV_TAILS", False)
        plain = matmul_plans.deep_gemv_config(rows_pad, n_chunks)
        monkeypatch.setattr(matmul_plans, "GEMV_TAILS", True)
        tailed = matmul_plans.deep_gemv_config(rows_pad, n_chunks)
        assert (plain.split_k, plain.U) == (split, u_divisor), (rows_pad, n_chunks, plain)
        assert (tailed.W, tailed.split_k, tailed.U) == (plain.W, split, u_tail), (rows_pad, n_chunks, tailed)


def test_where_k_is_long_the_wide_deep_default_runs_8_warps(monkeypatch):
    """DEEP_GEMV_WIDE_LONG_K: 8 warps where 4 would each walk 56 K steps or more (Llama-3-8B's down in q8_0 and q4_K,
    Qwen2.5-7B's down), 4 elsewhere; off, 4 everywhere."""
    cases = {(4096, 448): 8, (4096, 224): 8, (3584, 296): 8, (3584, 592): 8, (4096, 128): 4, (4608, 112): 4,
             (4096, 64): 4}
    for (rows_pad, n_chunks), warps in cases.items():
        monkeypatch.setattr(matmul_plans, "GEMV_TAILS", False)
        monkeypatch.setattr(matmul_plans, "DEEP_GEMV_WIDE_LONG_K", True)
        wide = matmul_plans.deep_gemv_config(rows_pad, n_chunks)
        monkeypatch.setattr(matmul_plans, "DEEP_GEMV_WIDE_LONG_K", False)
        assert (wide.W, matmul_plans.deep_gemv_config(rows_pad, n_chunks).W) == (warps, 4), (rows_pad, n_chunks)
        assert n_chunks % (wide.W * wide.split_k * wide.U) == 0 and wide.RT == 1


def test_a_warps_steps_need_only_divide_among_its_warps_and_splits():
    """quant_gemv.steps: U need not divide a warp's steps (the tail runs the rest); W x split_k must divide K."""
    planes = types.SimpleNamespace(qs=torch.empty(1, 56 * 512, dtype=torch.uint8))
    assert quant_gemv.steps(planes, GemvConfig(W=4, RT=1, split_k=1, U=8)) == 14
    assert quant_gemv.steps(planes, GemvConfig(W=2, RT=1, split_k=2, U=16)) == 14
    with pytest.raises(AssertionError):
        quant_gemv.steps(planes, GemvConfig(W=16, RT=1, split_k=1, U=1))


def test_shapes_without_a_plan_run_the_deep_default_unless_switched_off(monkeypatch):
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)   # the interpreter has its own small plan
    plan = matmul_plans.plan_for("q8_0", 4608, 3584, 3584, gemv=True)  # Qwen2.5-7B's qkv: no entry of its own
    assert plan.narrow == GemvPlan(matmul_plans.deep_gemv_config(4608, 112))
    monkeypatch.setattr(matmul_plans, "DEEP_GEMV_DEFAULT", False)
    plan = matmul_plans.plan_for("q8_0", 4608, 3584, 3584, gemv=True)
    assert plan.narrow == GemvPlan(matmul_plans.default_gemv_config("q8_0", 4608, 112))


def test_the_defaults_fill_the_gpu_they_run_on(monkeypatch):
    """A shape without a plan splits K to fill the device's multiprocessors: 2048 rows (128 row tiles) of 3584
    columns fill an A100's 108 with K whole, and take 7 splits on the H200's 132."""
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)   # the interpreter has its own small plan
    h200 = matmul_plans.plan_for("q8_0", 2048, 3584, 3584, gemv=True)
    a100 = matmul_plans.plan_for("q8_0", 2048, 3584, 3584, gemv=True, sms=108)
    assert h200.narrow == GemvPlan(matmul_plans.deep_gemv_config(2048, 112, 132)) and h200.narrow.default.split_k == 7
    assert a100.narrow == GemvPlan(matmul_plans.deep_gemv_config(2048, 112, 108)) and a100.narrow.default.split_k == 1


def test_routed_experts_walk_k_with_loads_ahead():
    """A routed launch drops split-K; its warps then walk every chunk, 4 K steps' loads in flight where they
    divide, and never fewer than the plan's."""
    from cobatch.kernels.packed_experts import without_split_k
    plan = GemvPlan(GemvConfig(W=4, RT=4, split_k=12, U=1), ((1, GemvConfig(W=4, RT=1, split_k=12, U=1)),))
    routed = without_split_k(plan, 48)
    assert [(c.split_k, c.U) for c in routed.configs()] == [(1, 4), (1, 4)]
    assert without_split_k(GemvPlan(GemvConfig(W=4, RT=4, split_k=2, U=8)), 64).default.U == 8
    assert without_split_k(GemvPlan(GemvConfig(W=4, RT=4, split_k=11, U=1)), 44).default.U == 1   # 11 a warp
    timed = GemvPlan(GemvConfig(W=2, RT=1, split_k=1, U=16), ((8, GemvConfig(W=2, RT=1, split_k=1, U=4)),))
    assert without_split_k(timed, 32) == timed      # a routed plan as a table names it: unchanged
    # a U that leaves a tail (the deep default's under GEMV_TAILS: 8 over 14 steps a split): routed launches keep
    # whole iterations (28 = 7 x 4)
    tailed = GemvPlan(GemvConfig(W=4, RT=1, split_k=2, U=8))
    assert quant_gemv.steps(types.SimpleNamespace(qs=torch.empty(1, 112 * 512)), tailed.default) % 8 == 6
    assert without_split_k(tailed, 112).default.U == 4
    assert without_split_k(GemvPlan(GemvConfig(W=4, RT=1, split_k=1, U=16)), 112).default.U == 4


def test_gemv_plan_tiers_must_split_k_the_same_way():
    """A row's bits depend on how K is split (W warps x split_k CTAs), so every tier must agree."""
    GemvPlan(GemvConfig(W=4, RT=4, split_k=2, U=1, D=2), ((1, GemvConfig(W=4, RT=1, split_k=2, U=8)),))
    with pytest.raises(ValueError):
        GemvPlan(GemvConfig(W=4, split_k=2), ((4, GemvConfig(W=8, split_k=2)),))
    with pytest.raises(ValueError):
        GemvPlan(GemvConfig(W=4, split_k=2), ((4, GemvConfig(W=4, split_k=4)),))
    with pytest.raises(ValueError):     # tiers out of order
        GemvPlan(GemvConfig(W=4), ((8, GemvConfig(W=4, RT=2)), (4, GemvConfig(W=4, RT=1))))


def test_gemv_plan_picks_the_tier_by_token_count():
    one, few, default = GemvConfig(W=4, RT=1, U=8), GemvConfig(W=4, RT=2, U=4), GemvConfig(W=4, RT=4)
    plan = GemvPlan(default, ((1, one), (8, few)))
    assert [plan.for_tokens(n) for n in (1, 2, 8, 9, 16, 64)] == [one, few, few, default, default, default]
    assert plan.configs() == [one, few, default]


def test_gemv_plan_scratch_covers_every_tier():
    """Each tier's split-K partials must fit: a 1-row-tile tier has more CTAs per token tile, a 16-token
    tile more tokens per CTA."""
    plan = GemvPlan(GemvConfig(W=4, RT=4, split_k=4), ((2, GemvConfig(W=4, RT=1, split_k=4, U=8)),
                                                       (8, GemvConfig(W=4, RT=2, split_k=4, U=4))))
    for max_tok in (1, 2, 8, 9, 16, 40):
        need = quant_gemv.scratch_need(plan, 4096, max_tok)
        for n_tok in range(1, max_tok + 1):
            elems, tiles = quant_gemv.scratch_need(plan.for_tokens(n_tok), 4096, n_tok)
            assert elems <= need[0] and tiles <= need[1], (max_tok, n_tok)


def test_only_calls_of_one_8_token_tile_or_after_attention_launch_as_programmatic_dependents(monkeypatch):
    """GEMV_PDL makes a call a programmatic dependent at the 8-token tile: a 16-token call may follow the mid-batch
    GEMM, which lets its dependents launch at its start (decode_gemv_pdl_ab.md), unless it follows decode attention
    (o's: `dependent`, GEMV_PDL_AFTER_ATTENTION). The launch itself is recorded here, not run (Gluon needs CUDA)."""
    assert quant_gemv.GEMV_PDL_AFTER_ATTENTION         # on by default
    launched = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda *args, **kwargs: launched.append(kwargs)

    monkeypatch.setattr(quant_gemv, "_gemv_kernel", Recorder(), raising=False)
    monkeypatch.setattr(quant_gemv, "pdl_launch", lambda t: {"PDL": True, "launch_pdl": True})
    planes = planes_of(make_weight("q8_0", 64, 256, seed=3))
    cfg = GemvConfig(W=4, RT=1, split_k=1, U=1)
    for gemv_pdl in (True, False):
        monkeypatch.setattr(quant_gemv, "GEMV_PDL", gemv_pdl)
        for n_tok in (1, 8, 9, 16):
            x = torch.zeros(n_tok, 256, dtype=torch.float16)
            quant_gemv.launch(planes, x, torch.empty(n_tok, 64), cfg, x, x)
    assert [k.get("launch_pdl", False) for k in launched] == [True, True, False, False] + [False] * 4
    assert [k.get("PDL", False) for k in launched] == [True, True, False, False] + [False] * 4
    # a call after decode attention (o's) at every tile, where GEMV_PDL_AFTER_ATTENTION is on
    launched.clear()
    monkeypatch.setattr(quant_gemv, "GEMV_PDL", True)
    for after in (True, False):
        monkeypatch.setattr(quant_gemv, "GEMV_PDL_AFTER_ATTENTION", after)
        for n_tok in (8, 16):
            for dependent in (True, False):
                x = torch.zeros(n_tok, 256, dtype=torch.float16)
                quant_gemv.launch(planes, x, torch.empty(n_tok, 64), cfg, x, x, dependent=dependent)
    assert [k.get("PDL", False) for k in launched] == [True, True, True, False] + [True, True, False, False]


def test_plan_reads_the_token_tiers(tmp_path, monkeypatch):
    table = {"formats": {"q8_0": {"shapes": {"4096x4096": {
        "gemv": {"W": 4, "RT": 4, "split_k": 2, "U": 1, "D": 2},
        "gemv_upto": {"8": {"W": 4, "RT": 2, "split_k": 2, "U": 4, "D": 0},
                      "2": {"W": 4, "RT": 1, "split_k": 2, "U": 8, "D": 0}}, "gemv_crossover": 32}}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)   # the interpreter has its own small plan
    plan = matmul_plans.plan_for("q8_0", 4096, 4096, 4096, gemv=True)
    assert plan.narrow == GemvPlan(GemvConfig(4, 4, 2, 1, 2), ((2, GemvConfig(4, 1, 2, 8, 0)),
                                                               (8, GemvConfig(4, 2, 2, 4, 0))))
    assert plan.crossover == 32
    no_entry = matmul_plans.plan_for("q8_0", 4096, 14336, 14336, gemv=True)   # the default config for every n_tok
    assert no_entry.narrow.upto == () and no_entry.narrow.default.split_k >= 1


def test_checkpoint_formats_take_the_plans_of_the_format_whose_loop_they_share(tmp_path, monkeypatch):
    """FP8 (q8_0's planes) and NVFP4 (q4_K's bytes a weight) without configs of their own for a shape run the GEMV
    plan of q8_0 / q4_K there; one of their own wins."""
    tier = {"W": 4, "RT": 1, "split_k": 2, "U": 8, "D": 0}
    table = {"formats": {"q8_0": {"shapes": {"4096x4096": {"gemv": {"W": 4, "RT": 2, "split_k": 2, "U": 4, "D": 0},
                                                           "gemv_upto": {"8": tier}}}},
                         "q4_k": {"shapes": {"4096x4096": {"gemv": {"W": 8, "RT": 2, "split_k": 1, "U": 2, "D": 0}}}},
                         "nvfp4": {"shapes": {"1024x4096": {"gemv": {"W": 2, "RT": 4, "split_k": 1, "U": 1, "D": 0}}}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    narrow = (lambda fmt, rows: matmul_plans.plan_for(fmt, rows, 4096, 4096, gemv=True).narrow)
    assert narrow("fp8_e4m3", 4096) == narrow("q8_0", 4096) == GemvPlan(GemvConfig(4, 2, 2, 4, 0),
                                                                        ((8, GemvConfig(**tier)),))
    assert narrow("nvfp4", 4096) == narrow("q4_k", 4096) == GemvPlan(GemvConfig(8, 2, 1, 2, 0))
    assert narrow("nvfp4", 1024) == GemvPlan(GemvConfig(2, 4, 1, 1, 0))


def test_the_5_bit_formats_take_the_plans_of_the_4_bit_format_they_extend(tmp_path, monkeypatch):
    """q5_K's planes are q4_K's (as q4_1's) with a fifth bit a weight, and the kernels' loops the same: without plans
    of its own it runs q4_K's, the mid-batch GEMM's ring configs included (the ring copies the fifth bits:
    its side tables name their layouts), but not q4_K's CUDA C++ configs (that kernel does not read its planes)."""
    ring = {"NW": 4, "split_k": 1, "RING": 8, "CHUNKS": 2, "LAG": True, "AHEAD": True}
    table = {"formats": {"q4_k": {"shapes": {"4096x4096": {
        "gemv": {"W": 8, "RT": 2, "split_k": 1, "U": 2, "D": 0}, "quant_gemm": ring, "quant_gemm_crossover": 16,
        "quant_gemm_first": {"kernel": "cuda", "WG": 1, "S": 8, "split_k": 2}, "quant_gemm_first_upto": 32}}}}}
    path = tmp_path / "configs.json"
    path.write_text(__import__("json").dumps(table))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)
    q4, q5 = (matmul_plans.plan_for(fmt, 4096, 4096, 4096, gemv=True, quant_gemm_too=True) for fmt in ("q4_k", "q5_k"))
    assert q5.narrow == q4.narrow == GemvPlan(GemvConfig(8, 2, 1, 2, 0))
    assert q5.mid == q4.mid == GemmConfig(**ring) and q5.crossover == 16
    assert q4.first is not None and q5.first is None
    assert quant_pack.Q5_1 in quant_gemm._SIDE_PER_CHUNK and quant_pack.Q5_0 in quant_gemm._SIDE_PER_CHUNK


# --- the kernel (CUDA) ------------------------------------------------------------------------------------

def run_poisoned(pw: PackedWeight, x: torch.Tensor, config=None) -> torch.Tensor:
    out = poisoned((x.shape[0], pw.rows), x.dtype, x.device)
    y = pw.matmul(x, config=config, out=out)
    assert torch.isfinite(y).all(), "unwritten (NaN-poisoned) or non-finite outputs"
    return y


@requires_cuda
@pytest.mark.parametrize("fmt_name", FRAGMENT)
def test_gemv_matches_reference_on_odd_shapes(fmt_name):
    """Rows not a multiple of any tile, K not a multiple of 256 (masked x), several configs."""
    for rows, cols in [(200, 768), (72, 320 if fmt_name not in K_QUANTS else 1280), (1000, 1024)]:
        w = make_weight(fmt_name, rows, cols, seed=3, device="cuda")
        pw = PackedWeight.from_quant(w, "cuda")
        assert pw.planes.fragment, "the Gluon path was not selected"
        ref_w = w.dequantize(torch.float32).double()
        gen = torch.Generator(device="cuda").manual_seed(4)
        n_chunks = pw.planes.qs.shape[1] // 512
        configs = [None] + [GemvConfig(W=wp, RT=rt, split_k=s, U=u, D=d, R=r) for wp, rt, s, u, d, r in
                            [(4, 1, 1, 1, 0, 0), (2, 2, 2, 1, 1, 128), (1, 4, 1, 2, 2, 0), (4, 2, 2, 2, 0, 96),
                             (2, 1, 4, 1, 3, 0), (4, 4, 1, 1, 9, 128), (4, 1, 1, 8, 0, 0), (8, 1, 1, 4, 2, 128)]
                            if n_chunks % (wp * s * u) == 0]     # prefetches past the last step are clamped
        # U not dividing a warp's steps: the steps past the last whole iteration run as the tail
        tails = [GemvConfig(W=wp, RT=rt, split_k=s, U=u, D=d, R=r) for wp, rt, s, u, d, r in
                 [(4, 1, 1, 4, 0, 128), (2, 1, 2, 3, 1, 0), (1, 2, 1, 16, 0, 128)]
                 if n_chunks % (wp * s) == 0 and n_chunks // (wp * s) % u]
        assert tails, (rows, cols, n_chunks)
        configs += tails
        for cfg in configs:
            for n_tok in (1, 3, 8, 9, 16):
                for dtype in (torch.float16, torch.bfloat16):
                    x = torch.randn(n_tok, cols, device="cuda", generator=gen).to(dtype)
                    y = run_poisoned(pw, x, config=cfg)
                    assert relative_error(y, x.double() @ ref_w.T) < 5e-3, (rows, cols, cfg, n_tok, dtype)


@requires_cuda
@pytest.mark.parametrize("fmt_name", FRAGMENT)
@pytest.mark.parametrize("plan", [None, GemvPlan(GemvConfig(W=4, RT=4, split_k=2, U=1, D=2),
                                                 ((1, GemvConfig(W=4, RT=1, split_k=2, U=8, R=128)),
                                                  (4, GemvConfig(W=4, RT=2, split_k=2, U=4)))),
                                  GemvPlan(GemvConfig(W=4, RT=2, split_k=2, U=3),     # tails of 1-8 steps
                                           ((1, GemvConfig(W=4, RT=1, split_k=2, U=6, R=128)),
                                            (4, GemvConfig(W=4, RT=1, split_k=2, U=16))))],
                         ids=["table", "tiers", "tails"])
def test_gemv_row_is_bitwise_identical_whatever_the_batch(fmt_name, plan):
    """Token counts 1, 2..4, 5..8 (8-token tiles) and 9..16 (a 16-token tile) run different configs of the
    plan: a row must not change."""
    w = make_weight(fmt_name, 4096, 4096, seed=5, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    if plan is None:
        plan = pw.plan.narrow                     # the package's plan for the shape, or the default plan
    else:
        assert plan.split_k > 1                  # the cross-CTA reduction is part of the check
    x = torch.randn(16, 4096, generator=torch.Generator().manual_seed(6)).to("cuda", torch.bfloat16)
    alone = torch.cat([run_poisoned(pw, x[t:t + 1], plan) for t in range(16)])
    for n_tok in range(2, 17):
        assert torch.equal(run_poisoned(pw, x[:n_tok], plan), alone[:n_tok]), n_tok


LEAN_LOOPS = [("GEMV_CLAMP_X",), ("GEMV_FOLD_STEPS",), ("GEMV_CLAMP_X", "GEMV_FOLD_STEPS")]


@requires_cuda
@pytest.mark.parametrize("fmt_name", FRAGMENT)
@pytest.mark.parametrize("switches", LEAN_LOOPS, ids="+".join)
def test_the_leaner_loops_give_the_bits_of_the_plain_one(fmt_name, switches, monkeypatch):
    """GEMV_CLAMP_X (a token tile's columns past the call read its last token's x instead of zeros) and
    GEMV_FOLD_STEPS (an iteration's steps take their offsets from one chunk, the pointers moved by constants) change
    instructions, not values: the call's rows keep their bits at 8- and 16-token tiles, with K split and not, U of
    1-16 with tails, 2 warps (q6_K's d then moves by a step that is no whole super-block), and a ragged K."""
    plans = [None, GemvPlan(GemvConfig(W=4, RT=2, split_k=2, U=3), ((1, GemvConfig(W=4, RT=1, split_k=2, U=6, R=128)),
                                                                   (8, GemvConfig(W=4, RT=1, split_k=2, U=16)))),
             GemvPlan(GemvConfig(W=2, RT=4, split_k=1, U=4), ((8, GemvConfig(W=2, RT=1, split_k=1, U=5)),))]
    gen = torch.Generator().manual_seed(8)
    for rows, cols in [(1024, 4096), (200, 320 if fmt_name not in K_QUANTS else 1280)]:     # K whole, K ragged
        pw = PackedWeight.from_quant(make_weight(fmt_name, rows, cols, seed=9, device="cuda"), "cuda")
        x = torch.randn(16, cols, generator=gen).to("cuda", torch.float16)
        for plan in plans if cols == 4096 else plans[:1]:
            for n_tok in (1, 3, 8, 11, 16):
                for name in LEAN_LOOPS[-1]:           # the plain loop: both off (both are on by default)
                    monkeypatch.setattr(quant_gemv, name, False)
                plain = run_poisoned(pw, x[:n_tok], plan)
                for name in switches:
                    monkeypatch.setattr(quant_gemv, name, True)
                assert torch.equal(run_poisoned(pw, x[:n_tok], plan), plain), (rows, cols, plan, n_tok)


@requires_cuda
@pytest.mark.parametrize("fmt_name", FRAGMENT)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
def test_gemv_act_epilogue_equals_the_act_kernel_after_it(fmt_name, act):
    """A gate|up weight packed interleaved: the GEMV's act*mul epilogue against the GEMV's own output put
    through the act*mul kernel (which reads the interleaved layout), under split-K and not, at 8- and
    16-token tiles, and with rows that end inside a row tile (inter 200: 400 rows of 512 padded); each
    token's row is also bitwise the same whatever the batch."""
    from cobatch.kernels.activation import gated_mul_triton
    inter, cols = 200, 1280
    gate, up = make_weight(fmt_name, inter, cols, seed=11), make_weight(fmt_name, inter, cols, seed=12)
    pw = PackedWeight.from_quant(QuantWeight.interleave_rows(gate, up, 8), "cuda", gate_up_interleaved=True)
    assert pw.planes.fragment
    x = torch.randn(16, cols, generator=torch.Generator().manual_seed(13)).to("cuda", torch.bfloat16)
    n_chunks = pw.planes.qs.shape[1] // 512
    for cfg in [None, GemvConfig(W=4, RT=2, split_k=1), GemvConfig(W=2, RT=4, split_k=2, U=1, R=128)]:
        if cfg is not None and n_chunks % (cfg.W * cfg.split_k * cfg.U):
            continue
        for n_tok in (1, 5, 16):
            full = pw.matmul(x[:n_tok], config=cfg)
            want = gated_mul_triton(full, act, interleaved=True)
            got = poisoned((n_tok, inter), torch.bfloat16, "cuda")
            pw.matmul(x[:n_tok], config=cfg, out=got, act=act)
            assert torch.isfinite(got).all(), (cfg, n_tok)
            torch.testing.assert_close(got, want, rtol=2 ** -7, atol=1e-5, msg=f"{cfg} {n_tok}")
        alone = torch.cat([pw.matmul(x[t:t + 1], config=cfg, act=act) for t in range(16)])
        assert torch.equal(pw.matmul(x, config=cfg, act=act), alone), cfg


@requires_cuda
@pytest.mark.parametrize("fmt_name", FRAGMENT)
def test_gemv_dequantize_kernel(fmt_name):
    rows, cols = 300, 768
    w = make_weight(fmt_name, rows, cols, seed=7, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    for dtype, bound in ((torch.float16, 2e-3), (torch.bfloat16, 1e-2)):   # bf16: 8-bit mantissa, scale and
        dense = torch.full((rows, cols), float("nan"), dtype=dtype, device="cuda")  # product each rounded
        qm.dequantize_planes(pw.planes, dense)
        assert relative_error(dense, w.dequantize(torch.float32)) < bound, dtype


@requires_cuda
def test_gemv_cuda_graph_replay():
    """A default plan that splits K (512 rows: 32 CTAs of one row tile a warp, K split to fill the SMs), so the
    split-K scratch and counters are part of the replay."""
    w = make_weight("q8_0", 512, 4096, seed=8, device="cuda")
    pw = PackedWeight.from_quant(w, "cuda")
    assert isinstance(pw.plan.narrow, GemvPlan) and pw.plan.narrow.split_k > 1
    x = torch.randn(5, 4096, device="cuda").to(torch.bfloat16)
    assert_graph_replay_matches(pw.matmul, x, torch.empty(5, 512, device="cuda", dtype=torch.bfloat16))


@requires_hopper
def test_a_chain_of_gemvs_as_programmatic_dependents_gives_the_bits_of_plain_launches(monkeypatch):
    """With GEMV_PDL, each GEMV starts while the kernel before finishes: its first weight bytes asked into L1, then
    the wait before x, the split-K scratch and its stores. A chain RMSNorm -> GEMV -> GEMV (act) -> GEMV -> ...
    (each reading the one before, split-K counters shared), eager and replayed in a CUDA graph, gives the bits of
    the same chain launched plainly; at 12 and 16 tokens too, each weight marked as o's is (follows_attention,
    GEMV_PDL_AFTER_ATTENTION)."""
    from cobatch.kernels import norm
    assert quant_gemv.pdl_launch(torch.empty(1, device="cuda"))["PDL"]
    gen = torch.Generator().manual_seed(37)
    cols = 2048
    weights = [PackedWeight.from_quant(make_weight(f, cols, cols, seed=50 + i, device="cuda"), "cuda")
               for i, f in enumerate(["q8_0", "q4_k", "q6_k", "q5_0", "nvfp4"])]
    gate, up = make_weight("q4_k", cols // 2, cols, seed=60), make_weight("q4_k", cols // 2, cols, seed=61)
    gate_up = PackedWeight.from_quant(QuantWeight.interleave_rows(gate, up, 8), "cuda", gate_up_interleaved=True)
    configs = [GemvConfig(W=4, RT=1, split_k=4, U=4, R=128), GemvConfig(W=4, RT=4, split_k=2, U=2),
               None, GemvConfig(W=2, RT=2, split_k=1, U=4), GemvConfig(W=4, RT=1, split_k=2, U=1)]
    norm_w = (torch.rand(cols, generator=gen) + 0.5).to("cuda", torch.bfloat16)
    x = torch.randn(8, cols, generator=gen).to("cuda", torch.bfloat16)

    def chain(x):
        for pw, cfg in zip(weights, configs):
            h, _ = norm.rms_norm_triton(x, norm_w, 1e-6)
            x = pw.matmul(h, config=cfg)
            x = torch.cat([gate_up.matmul(x, act="silu")] * 2, dim=1)      # a GEMV straight after a GEMV
        return x

    for pw in weights:          # as o's: 16-token tiles launch as dependents too under GEMV_PDL_AFTER_ATTENTION
        pw.follows_attention = True
    monkeypatch.setattr(quant_gemv, "GEMV_PDL_AFTER_ATTENTION", True)
    x = torch.cat([x, torch.randn(8, cols, generator=gen).to("cuda", torch.bfloat16)])
    for n_tok in (1, 8, 12, 16):
        monkeypatch.setattr(quant_gemv, "GEMV_PDL", False)
        want = chain(x[:n_tok])
        assert torch.isfinite(want).all() and want.abs().max() > 0
        monkeypatch.setattr(quant_gemv, "GEMV_PDL", True)
        assert torch.equal(chain(x[:n_tok]), want), n_tok
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            got = chain(x[:n_tok])
        for _ in range(3):
            got.zero_()
            graph.replay()
            assert torch.equal(got, want), n_tok


@requires_cuda
def test_gluon_is_used_for_the_fragment_formats_only():
    for fmt_name in ["q8_0", "q4_0", "q4_1", "q4_k", "q5_0", "q5_k", "q6_k"]:
        pw = PackedWeight.from_quant(make_weight(fmt_name, 128, 256, seed=9, device="cuda"), "cuda")
        assert pw.planes.fragment == (fmt_name in FRAGMENT)
        assert isinstance(pw.plan.narrow, GemvPlan) == (fmt_name in FRAGMENT)
    assert quant_gemv.gluon is not None


def test_operand_dtype_is_f16_where_the_gemv_or_gemm_reads_x():
    """PackedWeight.operand_dtype: f16 for bf16 rows that the GEMV or the mid-batch GEMM take (they read f16 as it
    is), the caller's dtype where the dequantize + cuBLAS path takes them (its matrix is in x's dtype) or where
    x is not bf16; the model's dtype throughout with the switch off."""
    from cobatch.kernels.quant_gemm_cuda import CudaGemmConfig
    w = make_weight("q8_0", 64, 256, seed=1)
    planes = planes_of(w)
    plan = matmul_plans.MatmulPlan(GemvPlan(GemvConfig()), matmul_plans.DEQUANT_CUBLAS, crossover=8,
                                   mid=CudaGemmConfig(), mid_upto=64)
    pw = PackedWeight("q8_0", 64, 256, planes=planes, plan=plan)
    assert [pw.operand_dtype(n, torch.bfloat16) for n in (1, 8, 9, 64, 65)] == [torch.float16] * 4 + [torch.bfloat16]
    assert pw.operand_dtype(1, torch.float32) == torch.float32
    assert pw.operand_dtype(1, torch.float16) == torch.float16
    dense = PackedWeight("q8_0", 64, 256, dense=torch.zeros(64, 256, dtype=torch.bfloat16))
    assert dense.operand_dtype(1, torch.bfloat16) == torch.bfloat16
    original = packed_weight.F16_OPERANDS
    try:
        packed_weight.F16_OPERANDS = False
        assert pw.operand_dtype(1, torch.bfloat16) == torch.bfloat16
    finally:
        packed_weight.F16_OPERANDS = original


def test_ops_operand_dtype_of_dense_packed_and_stacked_weights():
    """ops.operand_dtype: a packed weight's own choice, a stack's common one (the model's dtype where its parts
    differ), the model's dtype for a dense matrix or none; ops.linear then returns the model's dtype from an x in
    another."""
    from cobatch import ops
    from cobatch.models.linear import RowStack

    class Reads:
        def __init__(self, dtype):
            self.dtype, self.rows = dtype, 4

        def operand_dtype(self, rows, dtype):
            return self.dtype

    f16, bf16 = torch.float16, torch.bfloat16
    assert ops.operand_dtype(Reads(f16), 3, bf16) == f16
    assert ops.operand_dtype(RowStack([Reads(f16), Reads(f16)]), 3, bf16) == f16
    assert ops.operand_dtype(RowStack([Reads(f16), torch.zeros(4, 8)]), 3, bf16) == bf16
    assert ops.operand_dtype(torch.zeros(4, 8), 3, bf16) == bf16
    assert ops.operand_dtype(None, 3, bf16) == bf16
    x, w = torch.randn(3, 8, generator=torch.Generator().manual_seed(4)), torch.randn(4, 8)
    y = ops.linear(x.to(f16), w.to(f16), dtype=bf16)
    assert y.dtype == bf16 and torch.equal(y, torch.nn.functional.linear(x.to(f16), w.to(f16)).to(bf16))


@requires_cuda
@pytest.mark.parametrize("fmt_name", ["q8_0", "q4_k"])
def test_feed_forward_hands_down_its_input_in_f16(fmt_name):
    """ops.feed_forward: the gate|up GEMV's act*mul output in f16 where down's GEMV or GEMM reads it, down's output
    in the model's dtype; against float64 it is at least as close as with a bf16 intermediate (one rounding, from
    float32, instead of two), and a row's bits do not depend on the rows beside it."""
    from cobatch import ops
    from cobatch.kernels.activation import gated_mul_ref
    inter, cols = 512, 1024
    gate, up = make_weight(fmt_name, inter, cols, seed=21), make_weight(fmt_name, inter, cols, seed=22)
    down = make_weight(fmt_name, cols, inter, seed=23)
    gate_up = PackedWeight.from_quant(QuantWeight.interleave_rows(gate, up, 8), "cuda", gate_up_interleaved=True)
    down_pw = PackedWeight.from_quant(down, "cuda")
    h = torch.randn(40, cols, generator=torch.Generator().manual_seed(24)).to("cuda", torch.bfloat16)
    g, u = (w.dequantize(torch.float64).to("cuda") for w in (gate, up))
    want = gated_mul_ref(torch.cat([h.double() @ g.T, h.double() @ u.T], dim=1), "silu") \
        @ down.dequantize(torch.float64).to("cuda").T
    original = packed_weight.F16_OPERANDS
    assert [down_pw.operand_dtype(n, torch.bfloat16) for n in (1, 5)] == [torch.float16] * 2     # the GEMV's rows
    for n in (1, 5, 40):
        got = ops.feed_forward(h[:n], gate_up, down_pw)
        try:
            packed_weight.F16_OPERANDS = False
            old = ops.feed_forward(h[:n], gate_up, down_pw)
        finally:
            packed_weight.F16_OPERANDS = original
        assert got.dtype == torch.bfloat16 and got.shape == (n, cols)
        assert relative_error(got, want[:n]) <= 1.01 * relative_error(old, want[:n]) < 1e-2, n
    alone = torch.cat([ops.feed_forward(h[t:t + 1], gate_up, down_pw) for t in range(8)])
    assert torch.equal(ops.feed_forward(h[:8], gate_up, down_pw), alone)


def test_q5_0_weights_take_q8_0_only_when_asked_and_on_cuda_only(monkeypatch):
    """as_q8_0_on: Q5_0 weights keep their format (the GEMV reads its planes) unless COBATCH_Q5_0_AS_Q8_0=1 put it in
    AS_Q8_0; then a Q5_0 weight as Q8_0 (the same values) on CUDA, unchanged elsewhere and for other formats.
    PackedWeight.from_quant asks as_q8_0_on for every weight it packs by its own plan."""
    w = make_weight("q5_0", 32, 256, seed=31)
    assert packed_weight.AS_Q8_0 == () and packed_weight.as_q8_0_on(w, torch.device("cuda")) is w
    monkeypatch.setattr(packed_weight, "AS_Q8_0", ("q5_0",))
    assert packed_weight.as_q8_0_on(w, torch.device("cpu")) is w
    assert packed_weight.as_q8_0_on(make_weight("q4_k", 32, 256, seed=32), torch.device("cuda")).fmt.name == "q4_k"
    seen = []
    monkeypatch.setattr(packed_weight, "as_q8_0_on", lambda w, device: seen.append(w.fmt.name) or w)
    PackedWeight.from_quant(w, "cpu")
    assert seen == ["q5_0"]


@requires_cuda
def test_q5_0_as_q8_0_on_cuda_keeps_the_values(monkeypatch):
    monkeypatch.setattr(packed_weight, "AS_Q8_0", ("q5_0",))
    w = make_weight("q5_0", 64, 512, seed=33, device="cuda")
    q8 = packed_weight.as_q8_0_on(w, torch.device("cuda"))
    assert q8.fmt.name == "q8_0" and torch.equal(q8.dequantize(torch.float32), w.dequantize(torch.float32))
