"""W_UV applied to MLA's latent output (kernels/mla_value.py) against value_up_ref.

Tiny shapes run everywhere (the Triton interpreter on the CPU); ops.mla_value's choice of path, and the kernel at
DeepSeek-V2-Lite's shape, on CUDA.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from cobatch import ops  # noqa: E402
from cobatch.kernels import mla_value  # noqa: E402
from cobatch.kernels.operand_order import BY_32, NATURAL, ordered_ref  # noqa: E402
from conftest import requires_cuda  # noqa: E402
from kernel_checks import DEVICE, relative_error  # noqa: E402


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


@requires_cuda
@pytest.mark.parametrize("n", [1, 8, 16, 64])
def test_value_up_on_the_gpu_at_deepseek_v2_lites_shape(n, monkeypatch):
    """16 heads x 128 value dims from a 512-wide latent: within bf16's error of the reference (the kernel at any
    rows), and ops.mla_value takes it (up to MAX_ROWS rows) or leaves it to torch's batched product (more rows, or
    off)."""
    latent, w_uv = _inputs(n, heads=16, v=128, rank=512, device="cuda", seed=n)
    got = mla_value.value_up(latent, w_uv, torch.float16, NATURAL)
    assert relative_error(got, mla_value.value_up_ref(latent, w_uv)) < 1e-2
    monkeypatch.setattr(mla_value, "ENABLED", True)
    assert mla_value.takes(latent, w_uv) == (n <= mla_value.MAX_ROWS)
    big, _ = _inputs(mla_value.MAX_ROWS + 1, heads=16, v=128, rank=512, device="cuda")
    assert not mla_value.takes(big, w_uv)
