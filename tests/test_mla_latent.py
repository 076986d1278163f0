"""MLA's step prologue (kernels/mla_latent.py): the latent rows [rms_norm(c_kv) | rotated k_rope] written into the
cache and the queries' rope dims rotated, in one launch, against the ops it replaces (rms_norm_ref, rope_ref,
latent_write_ref). Tiny shapes in the interpreter on the CPU; DeepSeek-V2's (16 heads, 512 + 64) on CUDA."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch.kernels.mla_latent import mla_latent_ref, mla_latent_triton  # noqa: E402
from cobatch.kernels.rope import rope_cos_sin  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE, assert_matches, assert_same_cache  # noqa: E402


def check_mla_latent(n_rows: int, n_heads: int, nope: int, rank: int, rope: int, neox: bool, seed: int,
                     cache_dtype=torch.bfloat16) -> None:
    g = torch.Generator().manual_seed(seed)
    # q and kv_a as the model slices them out of one projection's rows: strided views
    proj = torch.randn(n_rows, n_heads * (nope + rope) + rank + rope, generator=g).to(DEVICE, torch.bfloat16)
    q_rope = proj[:, :n_heads * (nope + rope)].view(n_rows, n_heads, nope + rope)[..., nope:]
    kv_a = proj[:, n_heads * (nope + rope):]
    weight = (1 + torch.rand(rank, generator=g)).to(DEVICE, torch.bfloat16)
    positions = torch.randint(0, 200, (n_rows,), generator=g).to(DEVICE)
    cos_sin = rope_cos_sin(rope, 256, 10000.0).to(DEVICE)
    num_blocks, block_size = 4, 16
    cache = torch.randn(num_blocks, block_size, 1, rank + rope, generator=g).to(DEVICE, cache_dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:n_rows].to(DEVICE)
    slots[n_rows // 2] = -1                                         # a padded row: nothing written
    want_cache, got_cache = cache.clone(), cache.clone()
    want = mla_latent_ref(q_rope, kv_a, weight, 1e-6, positions, cos_sin, neox, want_cache, slots)
    got = mla_latent_triton(q_rope, kv_a, weight, 1e-6, positions, cos_sin, neox, got_cache, slots)
    assert got.shape == (n_rows, n_heads, rope) and got.is_contiguous()
    assert_matches(got, want)
    if cache_dtype == torch.bfloat16 and not got_cache.is_cuda:
        assert_same_cache(got_cache, want_cache)           # (the interpreter's bf16 rounding: kernel_checks)
    elif cache_dtype == torch.bfloat16:     # the norm's sum over c_kv added in another order than torch's
        assert_matches(got_cache, want_cache)
    else:   # and where that rounding lands on an fp8 midpoint, one fp8 step (2^-3) apart
        torch.testing.assert_close(got_cache.float(), want_cache.float(), rtol=0.13, atol=1e-2)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool, device=DEVICE)
    untouched[slots[slots >= 0]] = False
    width = rank + rope
    assert torch.equal(got_cache.view(-1, width)[untouched].float(), cache.view(-1, width)[untouched].float())


@pytest.mark.parametrize("neox", [False, True], ids=["pairs", "halves"])
def test_mla_latent_small(neox):
    check_mla_latent(n_rows=5, n_heads=3, nope=16, rank=48, rope=16, neox=neox, seed=1)


@requires_cuda
@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float8_e4m3fn], ids=["bf16", "fp8"])
@pytest.mark.parametrize("n_rows", [1, 64])
def test_mla_latent_deepseek_v2(n_rows, cache_dtype):
    check_mla_latent(n_rows=n_rows, n_heads=16, nope=128, rank=512, rope=64, neox=False, seed=n_rows,
                     cache_dtype=cache_dtype)
