"""MLA decode's split kernel in CUDA C++ (kernels/mla_decode_cuda.py, compiled by NVRTC).

CPU: where NVRTC is installed (the test extras install it), each variant the benchmark and the model may run
compiles for sm_90a without spills or serialized wgmmas, and the ring fits an SM. Hopper: outputs against the torch
reference (mla_attention_ref) at DeepSeek's latent shapes, 16 and 128 heads, one split and several, cache blocks of
16 and 64 rows, with every cache row past a sequence's length poisoned with NaN; a row's bits alone and among
others; CUDA-graph replay; the same with an fp8 (e4m3) cache, against the reference on the same rounded values.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch.batch import AttentionMetadata  # noqa: E402
from cobatch.kernels import mla_decode_cuda, nvrtc  # noqa: E402
from cobatch.kernels.attention import DecodeConfig  # noqa: E402
from cobatch.kernels.mla_attention import (MLA_CUDA_FP8_PLAN, MLA_CUDA_PLAN, mla_attention_ref,  # noqa: E402
                                           mla_decode_attention)
from cobatch.kernels.mla_decode_cuda import MlaCudaConfig  # noqa: E402
from conftest import requires_hopper  # noqa: E402
from kernel_checks import poisoned, relative_error  # noqa: E402

LAT, ROPE, SCALE = 512, 64, 192 ** -0.5
FP8 = torch.float8_e4m3fn
CONFIGS = [MlaCudaConfig(), MlaCudaConfig(segments=5, fp8_segments=20, out_bits=True), MlaCudaConfig(early=False),
           MlaCudaConfig(producers=2, fp8_producers=1), MlaCudaConfig(producers=4, fp8_segments=20, fp8_producers=4)]
CONFIG_IDS = ["rings10-8", "rings5-20-bits", "late", "producers2-1", "producers4-4"]


@pytest.mark.skipif(not nvrtc.available(), reason="NVRTC (nvidia-cuda-nvrtc) is not installed")
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
@pytest.mark.parametrize("single,bf16,block,fp8", [(False, True, 16, False), (True, True, 64, False),
                                                  (False, False, 64, False), (False, True, 16, True),
                                                  (True, True, 64, True), (False, False, 64, True)])
def test_kernel_compiles_without_spills_or_serialized_wgmma(cfg, single, bf16, block, fp8):
    _, log = nvrtc.compile_cubin(mla_decode_cuda.source(cfg, LAT, ROPE, block, single, bf16, True, 64, fp8),
                                 "mla_decode", "90a", ("--ptxas-options=-v",))
    assert "spill" not in log or " 0 bytes spill stores, 0 bytes spill loads" in log, log
    assert "C751" not in log, log          # ptxas's "wgmma serialized" warnings
    assert mla_decode_cuda.smem_bytes(cfg, LAT, ROPE, fp8) <= mla_decode_cuda.SMEM_LIMIT


def test_an_fp8_ring_holds_the_bytes_of_the_16_bit_one():
    """e4m3 rows are half as wide: a ring of 20 fp8 segments takes about the shared memory of the default 10 bf16
    ones, and the default fp8 ring of 8 leaves room for two CTAs an SM."""
    cfg = MlaCudaConfig()
    wide = MlaCudaConfig(fp8_segments=2 * cfg.segments)
    assert abs(mla_decode_cuda.smem_bytes(wide, LAT, ROPE, True) - mla_decode_cuda.smem_bytes(cfg, LAT, ROPE)) < 4096
    assert mla_decode_cuda.ctas_per_sm(cfg, LAT, ROPE, True) == 2 and cfg.ring(True) == 8
    assert mla_decode_cuda.ctas_per_sm(wide, LAT, ROPE, True) == 1 and mla_decode_cuda.ctas_per_sm(cfg, LAT, ROPE) == 1


def test_unsupported_calls_say_why():
    """DeepSeek's shapes run; another dtype, tile, block size, ring or alignment says why not (the Triton kernel
    takes those calls)."""
    q = torch.zeros(2, 16, LAT + ROPE, dtype=torch.bfloat16)
    lat, rope = q[..., :LAT], q[..., LAT:]
    cache = torch.zeros(4, 16, LAT + ROPE, dtype=torch.bfloat16)
    assert mla_decode_cuda.unsupported(lat, rope, cache, 64) is None
    assert "dtypes" in mla_decode_cuda.unsupported(lat.float(), rope.float(), cache.float(), 64)
    assert "tiles" in mla_decode_cuda.unsupported(lat, rope, cache, 32)
    assert "segments of 16" in mla_decode_cuda.unsupported(lat, rope, cache.view(8, 8, LAT + ROPE), 64)
    assert "ring" in mla_decode_cuda.unsupported(lat, rope, cache, 64, MlaCudaConfig(segments=3))
    assert "ring" in mla_decode_cuda.unsupported(lat, rope, cache, 64, MlaCudaConfig(segments=12))
    odd = torch.zeros(2, 16, LAT + ROPE + 4, dtype=torch.bfloat16)[..., :LAT + ROPE]   # rows 580 values apart
    assert "aligned" in mla_decode_cuda.unsupported(odd[..., :LAT], odd[..., LAT:], cache, 64)
    assert not mla_decode_cuda.supports(lat, rope, cache, 64)          # not on the CPU
    fp8 = cache.to(FP8)
    assert "COBATCH_MLA_CUDA_FP8=0" in mla_decode_cuda.unsupported(lat, rope, fp8, 64, fp8=False)
    assert mla_decode_cuda.unsupported(lat, rope, fp8, 64, fp8=True) is None
    assert "128" in mla_decode_cuda.unsupported(q[..., :LAT - 64], q[..., LAT - 64:], fp8, 64, fp8=True)
    assert "dtypes" in mla_decode_cuda.unsupported(lat.float(), rope.float(), fp8, 64, fp8=True)
    assert "ring" in mla_decode_cuda.unsupported(lat, rope, fp8, 64, MlaCudaConfig(fp8_segments=24), fp8=True)


def _latent_inputs(seq_lens: list[int], n_heads: int, block: int, seed: int, dtype=torch.bfloat16):
    """Random queries and a latent cache whose rows past each sequence's length (and unused blocks) hold NaN; each
    sequence's blocks scattered over the pool."""
    g = torch.Generator().manual_seed(seed)
    blocks = [-(-n // block) for n in seq_lens]
    pool = torch.full((sum(blocks) + 2, block, 1, LAT + ROPE), float("nan"), dtype=dtype)
    tables = torch.zeros(len(seq_lens), max(max(blocks), 1), dtype=torch.int32)
    order = torch.randperm(pool.shape[0], generator=g).tolist()
    for r, (n, nb) in enumerate(zip(seq_lens, blocks)):
        for i in range(nb):
            b = order.pop()
            tables[r, i] = b
            rows = min(block, n - i * block)
            pool[b, :rows] = torch.randn(rows, 1, LAT + ROPE, generator=g).to(dtype)
    q = torch.randn(len(seq_lens), n_heads, LAT + ROPE, generator=g).to(dtype)
    n = len(seq_lens)
    meta = AttentionMetadata(torch.zeros(n, dtype=torch.int64), torch.arange(n + 1, dtype=torch.int32),
                             torch.tensor(seq_lens, dtype=torch.int32), tables, 1, max(max(seq_lens), 1))
    meta = AttentionMetadata(*(t.cuda() for t in (meta.slot_mapping, meta.query_start, meta.seq_lens,
                                                  meta.block_tables)), 1, meta.max_seq_len)
    return q.cuda(), pool.cuda(), meta


def _reference(q, pool, meta):
    return mla_attention_ref(q, torch.nan_to_num(pool), meta, SCALE, LAT)


# a plan of one split (the kernel stores the rows' outputs itself) and one of up to 8 splits
ONE_SPLIT = DecodeConfig(max_splits=1)
SPLITS = DecodeConfig(min_split=64, max_splits=8, programs_per_sm=64)


@requires_hopper
@pytest.mark.parametrize("n_heads", [16, 128, 20])
@pytest.mark.parametrize("plan", [MLA_CUDA_PLAN, ONE_SPLIT, SPLITS], ids=["default", "one", "splits"])
@pytest.mark.parametrize("block", [16, 64])
def test_matches_the_reference(n_heads, plan, block):
    """Rows of one token, a page and a bit, a tile and a bit, several splits, an empty (padded) row; 20 heads: a
    second head block with 4 heads."""
    q, pool, meta = _latent_inputs([1, 17, 65, 700, 0, 4000], n_heads, block, seed=n_heads + block)
    q_lat, q_rope = q[..., :LAT], q[..., LAT:]
    assert mla_decode_cuda.supports(q_lat, q_rope, pool.flatten(2), 64)
    got = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((6, n_heads, LAT), torch.bfloat16), cfg=plan,
                               cuda=True)
    assert torch.isfinite(got).all()
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    assert relative_error(got, _reference(q, pool, meta)) < 1e-2


@requires_hopper
def test_f16_matches_the_reference_and_a_float32_output_takes_the_triton_kernel():
    q, pool, meta = _latent_inputs([1, 300, 5000], 16, 16, seed=13, dtype=torch.float16)
    got = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((3, 16, LAT), torch.float16), cuda=True)
    assert relative_error(got, _reference(q, pool, meta)) < 1e-2
    assert not mla_decode_cuda.supports(q[..., :LAT], q[..., LAT:], pool.flatten(2), 64,
                                        meta=AttentionMetadata(meta.slot_mapping, meta.query_start,
                                                               meta.seq_lens.long(), meta.block_tables, 1,
                                                               meta.max_seq_len))
    wide = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((3, 16, LAT), torch.float32), cuda=True)
    assert relative_error(wide, _reference(q, pool, meta)) < 1e-2


@requires_hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_each_ring_gives_the_same_bits(cfg):
    q, pool, meta = _latent_inputs([3000, 129, 8192], 16, 16, seed=9)
    want = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True)
    assert relative_error(want, _reference(q, pool, meta)) < 1e-2
    assert torch.equal(mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True, cuda_cfg=cfg), want)


def test_producer_warps_join_the_consumer_warpgroup():
    """The ring's copies are issued by one or more producer warps beside the 128 consumer threads, fp8 caches taking
    their own count (two each by default)."""
    assert mla_decode_cuda.threads(MlaCudaConfig()) == mla_decode_cuda.threads(MlaCudaConfig(), fp8=True) == 192
    assert mla_decode_cuda.threads(MlaCudaConfig(producers=4, fp8_producers=1), fp8=False) == 256


@requires_hopper
@pytest.mark.parametrize("n_heads", [16, 20])
@pytest.mark.parametrize("fp8", [False, True])
def test_any_count_of_producer_warps_gives_the_same_bits(cuda_fp8, n_heads, fp8):
    """Producer warp p copies segments p, p + P, ...: rows that end mid-segment, several splits a program, a second
    head block and an empty row get the bits of one producer."""
    q, pool, meta = _latent_inputs([1, 17, 65, 700, 0, 4000], n_heads, 16, seed=n_heads + 3)
    if fp8:
        pool = pool.to(FP8)
    one = mla_decode_attention(q, pool, meta, SCALE, LAT, cfg=SPLITS, cuda=True,
                               cuda_cfg=MlaCudaConfig(producers=1, fp8_producers=1))
    assert relative_error(one, mla_attention_ref(q, torch.nan_to_num(pool.float()), meta, SCALE, LAT)) < 1e-2
    for producers in (2, 3, 4):
        many = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((6, n_heads, LAT), torch.bfloat16),
                                    cfg=SPLITS, cuda=True,
                                    cuda_cfg=MlaCudaConfig(producers=producers, fp8_producers=producers))
        assert torch.equal(many, one), producers


@requires_hopper
def test_a_row_has_the_same_bits_alone_and_batched():
    """Up to DecodeConfig.invariant_rows rows split as one row does."""
    q, pool, meta = _latent_inputs([5000, 40, 700], 16, 16, seed=11)
    batched = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True)
    for r in range(3):
        alone = AttentionMetadata(meta.slot_mapping[r:r + 1], meta.query_start[:2], meta.seq_lens[r:r + 1],
                                  meta.block_tables[r:r + 1], 1, meta.max_seq_len)
        assert torch.equal(mla_decode_attention(q[r:r + 1], pool, alone, SCALE, LAT, cuda=True), batched[r:r + 1]), r


@requires_hopper
def test_graph_replay():
    """Captured once and replayed with new queries and longer rows: each replay writes every output and equals an
    eager call."""
    q, pool, meta = _latent_inputs([900, 2000, 33, 1], 16, 16, seed=12)
    out = torch.empty(4, 16, LAT, dtype=torch.bfloat16, device="cuda")
    mla_decode_attention(q, pool, meta, SCALE, LAT, out=out, cuda=True)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        mla_decode_attention(q, pool, meta, SCALE, LAT, out=out, cuda=True)
    for step in range(3):
        q.copy_(torch.randn_like(q))
        meta.seq_lens.copy_(torch.tensor([900 - step, 2000, 33 - step, 1], dtype=torch.int32))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True))


@pytest.fixture
def cuda_fp8(monkeypatch):
    """The CUDA kernel takes fp8 caches (the default; COBATCH_MLA_CUDA_FP8=0 gives them to the Triton kernels)."""
    monkeypatch.setattr(mla_decode_cuda, "MLA_CUDA_FP8", True)


def _fp8_inputs(seq_lens: list[int], n_heads: int, block: int, seed: int, dtype=torch.bfloat16):
    """_latent_inputs with the cache in e4m3 (rows past each length stay NaN), and the reference on those values."""
    q, pool, meta = _latent_inputs(seq_lens, n_heads, block, seed, dtype)
    pool = pool.to(FP8)
    return q, pool, meta, mla_attention_ref(q, torch.nan_to_num(pool.float()), meta, SCALE, LAT)


@requires_hopper
@pytest.mark.parametrize("n_heads", [16, 128, 20])
@pytest.mark.parametrize("plan", [MLA_CUDA_FP8_PLAN, ONE_SPLIT, SPLITS], ids=["default", "one", "splits"])
@pytest.mark.parametrize("block", [16, 64])
def test_an_fp8_cache_matches_the_reference(cuda_fp8, n_heads, plan, block):
    """As test_matches_the_reference, the rows in e4m3: widened to f16 beside f16 queries (bf16 ones converted)."""
    q, pool, meta, ref = _fp8_inputs([1, 17, 65, 700, 0, 4000], n_heads, block, seed=n_heads + block)
    assert mla_decode_cuda.supports(q[..., :LAT], q[..., LAT:], pool.flatten(2), 64)
    got = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((6, n_heads, LAT), torch.bfloat16), cfg=plan,
                               cuda=True)
    assert torch.isfinite(got).all()
    assert torch.equal(got[4], torch.zeros_like(got[4]))
    assert relative_error(got, ref) < 1e-2


@requires_hopper
def test_an_fp8_cache_with_f16_queries_and_the_triton_kernel_agree(cuda_fp8):
    """f16 queries (no conversion in the queries' image), and the Triton kernels on the same call within the same
    bound: both read the same e4m3 values."""
    q, pool, meta, ref = _fp8_inputs([1, 300, 5000], 16, 16, seed=13, dtype=torch.float16)
    got = mla_decode_attention(q, pool, meta, SCALE, LAT, out=poisoned((3, 16, LAT), torch.float16), cuda=True)
    assert relative_error(got, ref) < 1e-2
    triton = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=False)
    assert relative_error(triton, ref) < 1e-2


@requires_hopper
@pytest.mark.parametrize("cfg", CONFIGS, ids=CONFIG_IDS)
def test_each_fp8_ring_gives_the_same_bits(cuda_fp8, cfg):
    """Any ring depth gives the bits of the default ring with the same widening; widened by bit moves (the values
    times 2^-8, undone by powers of two) the outputs agree with the cvt's within f16's rounding of e4m3's subnormals
    (they stay exact unless the tensor cores flush f16 subnormals)."""
    q, pool, meta, ref = _fp8_inputs([3000, 129, 8192], 16, 16, seed=9)
    want = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True, cuda_cfg=MlaCudaConfig(out_bits=cfg.out_bits))
    assert relative_error(want, ref) < 1e-2
    assert torch.equal(mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True, cuda_cfg=cfg), want)
    by_cvt = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True)
    assert relative_error(want, by_cvt) < 1e-3


@requires_hopper
def test_an_fp8_row_has_the_same_bits_alone_and_batched(cuda_fp8):
    q, pool, meta, _ = _fp8_inputs([5000, 40, 700], 16, 16, seed=11)
    batched = mla_decode_attention(q, pool, meta, SCALE, LAT, cuda=True)
    for r in range(3):
        alone = AttentionMetadata(meta.slot_mapping[r:r + 1], meta.query_start[:2], meta.seq_lens[r:r + 1],
                                  meta.block_tables[r:r + 1], 1, meta.max_seq_len)
        assert torch.equal(mla_decode_attention(q[r:r + 1], pool, alone, SCALE, LAT, cuda=True), batched[r:r + 1]), r
