"""The RMSNorm folded into the GEMV (kernels/folded_norm.py, COBATCH_FOLD_NORM=1) against the norm's own kernel
followed by the GEMV: the same bits, so a row decodes alike whether its step folds the norm or not. CUDA only (Gluon
has no interpreter); the CPU suite compiles these kernels for sm_90 (test_kernels_compile.py)."""

from __future__ import annotations

import pytest
import torch

from cobatch import ops
from cobatch.kernels import folded_norm
from cobatch.kernels.folded_norm import rms_norm_gluon
from cobatch.kernels.norm import rms_norm_ref
from cobatch.kernels.packed_weight import PackedWeight
from cobatch.kernels.quant_gemv import FoldedNorm, GemvConfig
from conftest import requires_cuda, requires_hopper
from kernel_checks import poisoned, relative_error
from test_quant_gemv import make_weight

EPS = 1e-5
# the formats whose GEMV chunks load x with their scales (the fold's); each with the plans' two kinds of config
FOLD_FORMATS = ["q8_0", "q4_k", "q4_0", "q5_0", "fp8_e4m3"]
CONFIGS = [GemvConfig(W=4, RT=1, split_k=4, U=2), GemvConfig(W=4, RT=4, split_k=1, U=2, R=128)]


def _rows(n_tok: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(n_tok, cols, generator=g) * 3).to("cuda", torch.bfloat16)
    residual = (torch.randn(n_tok, cols, generator=g) * 20).to("cuda", torch.bfloat16)    # a residual stream's size
    weight = (1 + 0.2 * torch.randn(cols, generator=g)).to("cuda", torch.bfloat16)
    return x, residual, weight


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("cols", [576, 4096])
def test_the_norms_kernel_matches_the_reference(cols):
    """The residual stream exactly (one rounded add), the normed rows within f16 rounding of the reference's (their
    sums run in another order); and in place, the residual updated."""
    x, residual, weight = _rows(5, cols, seed=1)
    out, stream = rms_norm_gluon(x, weight, EPS, residual, out=torch.empty(5, cols, dtype=torch.float16, device="cuda"))
    want, want_stream = rms_norm_ref(x, weight, EPS, residual, torch.float16)
    assert torch.equal(stream, want_stream) and relative_error(out, want) < 2e-3
    again = residual.clone()
    rms_norm_gluon(x, weight, EPS, again, residual_out=again)
    assert torch.equal(again, want_stream)
    plain, _ = rms_norm_gluon(x, weight, EPS)
    assert relative_error(plain, rms_norm_ref(x, weight, EPS)[0]) < 2e-3


@requires_cuda
@requires_hopper
@pytest.mark.parametrize("fmt_name", FOLD_FORMATS)
@pytest.mark.parametrize("with_residual", [True, False])
def test_the_folded_norm_gives_the_unfolded_bits(fmt_name, with_residual):
    pw = PackedWeight.from_quant(make_weight(fmt_name, 1024, 4096, seed=3), "cuda")
    for n_tok in (1, 3, 8):
        x, residual, weight = _rows(n_tok, 4096, seed=n_tok)
        residual = residual if with_residual else None
        normed, stream = rms_norm_gluon(x, weight, EPS, residual,
                                        out=torch.empty(n_tok, 4096, dtype=torch.float16, device="cuda"))
        for config in CONFIGS:
            want = pw.matmul(normed, config=config, out=poisoned((n_tok, 1024), torch.bfloat16))
            stream_out = poisoned((n_tok, 4096), torch.bfloat16) if with_residual else None
            got = pw.matmul(x, config=config, out=poisoned((n_tok, 1024), torch.bfloat16),
                            norm=FoldedNorm(weight, EPS, residual, stream_out))
            assert torch.equal(got, want), (fmt_name, n_tok, config)
            if with_residual:
                assert torch.equal(stream_out, stream), (fmt_name, n_tok, config)


@requires_cuda
@requires_hopper
def test_a_model_decodes_alike_with_the_norm_folded(monkeypatch):
    """A whole model (SmolLM2 cut to 6 layers, q4_1) loaded with the fold on: its B = 1 steps fold the norms into
    the GEMVs of qkv and gate|up (graphs captured so), its wider steps run the norm's kernel. A row's tokens are
    the same alone (every decode step folded) and among others arriving two every other step (as
    test_gpu_engine's batched test: the prefill rows stay in the GEMV's range), and close to the unfolded decode."""
    from cobatch.llm import LLM, EngineOptions
    from test_gpu_engine import GREEDY, PROMPTS, _cut_model, _staggered

    def load() -> LLM:
        return LLM.load(_cut_model(), EngineOptions(device="cuda", dtype="f16", ctx=256, max_num_seqs=8, quiet=True,
                                                    kv_cache_gb=1))

    plain = load()
    prompts = [plain.encode_prompt(p) for p in PROMPTS[:4]]
    unfolded = [plain.engine.generate([p], GREEDY)[0] for p in prompts]
    del plain
    monkeypatch.setattr(folded_norm, "FOLD_NORM", True)
    monkeypatch.setattr(ops, "FOLD_NORM", True)
    folded = load()
    assert any(layer.gate_up.folds_norm(1) for layer in folded.model.layers if hasattr(layer.gate_up, "folds_norm"))
    alone = [folded.engine.generate([p], GREEDY)[0] for p in prompts]
    assert _staggered(folded.engine, prompts) == alone
    agree = sum(a == b for u, f in zip(unfolded, alone) for a, b in zip(u, f)) / sum(map(len, alone))
    assert agree >= 0.9, agree
