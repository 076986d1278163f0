"""W_UV applied to MLA's latent output (kernels/mla_value.py) against value_up_ref.

Tiny shapes run everywhere (the Triton interpreter on the CPU); ops.mla_value's choice of path, and the kernel at
DeepSeek-V2-Lite's shape, on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.batch import AttentionMetadata  # noqa: E402
from cobatch.kernels import mla_value  # noqa: E402
from cobatch.kernels.attention import DecodeConfig, SplitPartials  # noqa: E402
from cobatch.kernels.mla_attention import mla_decode_attention  # noqa: E402
from cobatch.kernels.operand_order import BY_32, NATURAL, ordered_ref  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE, paged_setup, relative_error  # noqa: E402

SPLIT = DecodeConfig(block_n=16, min_split=16, max_splits=8, programs_per_sm=64)
UNSPLIT = DecodeConfig(block_n=16, max_splits=1)


def _inputs(n: int, heads: int = 3, v: int = 64, rank: int = 64, device: str = DEVICE, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    latent = torch.randn(n, heads, rank, generator=g).to(device, torch.bfloat16)
    w_uv = (torch.randn(heads, v, rank, generator=g) / rank ** 0.5).to(device, torch.bfloat16)
    return latent, w_uv


@pytest.mark.parametrize("n", [1, 5, 17, 40])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_value_up_matches_the_reference(n, out_dtype):
    latent, w_uv = _inputs(n, seed=n)
    got = mla_value.value_up(latent, w_uv, out_dtype, NATURAL)
    assert got.dtype == out_dtype and got.shape == (n, 3 * 64)
    assert relative_error(got, mla_value.value_up_ref(latent, w_uv)) < 1e-2


def test_a_rows_bits_do_not_depend_on_the_step():
    """Row t of a 40-row step has the bits of the same row alone (tiles of a fixed BLOCK_N rows)."""
    latent, w_uv = _inputs(40, seed=3)
    batched = mla_value.value_up(latent, w_uv, torch.bfloat16, NATURAL)
    for t in (0, 17, 39):
        assert torch.equal(mla_value.value_up(latent[t:t + 1], w_uv, torch.bfloat16, NATURAL)[0], batched[t])


def test_value_up_stores_the_next_gemms_column_order():
    """ORDER: each value where o's GEMM reads it (operand_order.ordered_ref of the natural row)."""
    latent, w_uv = _inputs(6, seed=4)
    natural = mla_value.value_up(latent, w_uv, torch.float16, NATURAL)
    assert torch.equal(mla_value.value_up(latent, w_uv, torch.float16, BY_32), ordered_ref(natural, BY_32))


def test_the_kernel_is_off_or_declines_what_it_cannot_tile(monkeypatch):
    latent, w_uv = _inputs(4, device="cpu")
    assert not mla_value.takes(latent, w_uv)                     # the CPU: torch's batched product
    monkeypatch.setattr(mla_value, "ENABLED", True)
    assert not mla_value.takes(latent, w_uv)                     # still the CPU
    out, order = ops.mla_value(latent, w_uv, w_uv.new_zeros(5, 3 * 64), torch.bfloat16)
    assert order == NATURAL and relative_error(out, mla_value.value_up_ref(latent, w_uv)) < 1e-2


def _split_step(seq_lens, heads=20, lat=16, rope=8, v=32, seed=5, cfg=SPLIT):
    """A decode step's MLA left unmerged (SplitPartials, where it splits) and merged, and a random W_UV."""
    q, cache, _, meta = paged_setup(seq_lens, [1] * len(seq_lens), heads, 1, lat + rope, torch.bfloat16, seed)
    partials = mla_decode_attention(q, cache, meta, 0.3, lat, cfg=cfg, merge=False)
    merged = mla_decode_attention(q, cache, meta, 0.3, lat, cfg=cfg)
    w_uv = _inputs(1, heads=heads, v=v, rank=lat, seed=seed)[1]
    return q, cache, meta, partials, merged, w_uv


@pytest.mark.parametrize("order", [NATURAL, BY_32])
def test_split_partials_merged_as_loaded_give_the_reduce_kernels_rows(order):
    """Rows of one token, of several splits, and an empty (padded) row, 20 heads: merged inside the kernel as the
    reduce kernel merges them (its _merged_row, rounded as it stores). The interpreter runs both merges as the same
    operations, so the bits agree; compiled, the two kernels may order the merge's last sum apart."""
    _, _, _, partials, merged, w_uv = _split_step([1, 17, 50, 0])
    assert isinstance(partials, SplitPartials) and partials.num_splits > 1 and partials.shape == merged.shape
    got = mla_value.value_up(partials, w_uv, torch.float16, order)
    want = mla_value.value_up(merged, w_uv, torch.float16, order)
    assert torch.equal(got[3], torch.zeros_like(got[3]))
    if DEVICE == "cpu":
        assert torch.equal(got, want)
    else:
        assert relative_error(got, want) < 1e-3


def test_a_merged_rows_bits_do_not_depend_on_the_step():
    _, _, meta, partials, _, w_uv = _split_step([50, 5, 33])
    batched = mla_value.value_up(partials, w_uv, torch.bfloat16, NATURAL)
    for r in range(3):
        q, cache, _, _, _, _ = _split_step([50, 5, 33])
        alone = AttentionMetadata(meta.slot_mapping[r:r + 1], meta.query_start[:2], meta.seq_lens[r:r + 1],
                                  meta.block_tables[r:r + 1], 1, meta.max_seq_len)
        split = mla_decode_attention(q[r:r + 1], cache, alone, 0.3, 16, cfg=SPLIT, merge=False)
        assert torch.equal(mla_value.value_up(split, w_uv, torch.bfloat16, NATURAL)[0], batched[r]), r


def test_a_step_that_does_not_split_comes_back_merged():
    _, _, _, partials, merged, _ = _split_step([1, 17, 50, 0], cfg=UNSPLIT)
    assert isinstance(partials, torch.Tensor) and torch.equal(partials, merged)


@requires_cuda
@pytest.mark.parametrize("n", [1, 8, 64])
def test_value_up_on_the_gpu_at_deepseek_v2_lites_shape(n, monkeypatch):
    """16 heads x 128 value dims from a 512-wide latent: within bf16's error of the reference, and ops.mla_value
    takes it (up to MAX_ROWS rows) or leaves it to torch's batched product (more rows, or off)."""
    latent, w_uv = _inputs(n, heads=16, v=128, rank=512, device="cuda", seed=n)
    got = mla_value.value_up(latent, w_uv, torch.float16, NATURAL)
    assert relative_error(got, mla_value.value_up_ref(latent, w_uv)) < 1e-2
    monkeypatch.setattr(mla_value, "ENABLED", True)
    assert mla_value.takes(latent, w_uv)
    big, _ = _inputs(mla_value.MAX_ROWS + 1, heads=16, v=128, rank=512, device="cuda")
    assert not mla_value.takes(big, w_uv)


@requires_cuda
@pytest.mark.parametrize("seq_lens", [[300], [1, 300, 2000, 0]])
def test_split_partials_of_the_cuda_mla_kernel_at_deepseek_v2_lites_shape(seq_lens, monkeypatch):
    """The default decode kernel's partials (16 heads, latent 512 and rope 64) merged as loaded: within bf16's error
    of the reduce kernel's rows taken through W_UV, and ops.mla_attention leaves them unmerged where the kernel is
    on."""
    _, _, meta, partials, merged, w_uv = _split_step(seq_lens, heads=16, lat=512, rope=64, v=128, cfg=None)
    assert isinstance(partials, SplitPartials)
    got = mla_value.value_up(partials, w_uv, torch.bfloat16, NATURAL)
    assert relative_error(got, mla_value.value_up(merged, w_uv, torch.bfloat16, NATURAL)) < 1e-3
    q, cache = _split_step(seq_lens, heads=16, lat=512, rope=64, v=128, cfg=None)[:2]
    monkeypatch.setattr(mla_value, "ENABLED", True)
    left = ops.mla_attention(q[..., :512], q[..., 512:], cache, meta, 0.3, w_uv=w_uv)
    assert isinstance(left, SplitPartials) and mla_value.takes(left, w_uv)
    monkeypatch.setattr(mla_value, "MERGES", False)
    assert isinstance(ops.mla_attention(q[..., :512], q[..., 512:], cache, meta, 0.3, w_uv=w_uv), torch.Tensor)
