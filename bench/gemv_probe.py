"""Quick probe of the Gluon GEMV on the GPU (first thing a device call runs): per format, the dequantize
kernel and the GEMV against the float64 reference on a small odd shape; on a mismatch, saves the dense
tiles (got / expected) under $OUT for offline diagnosis. Prints one line per format."""

import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
from cobatch.kernels import packed_weight  # noqa: E402
from cobatch.kernels import quant_matmul as qm  # noqa: E402
from cobatch.quant.formats import format_of, random_quantized  # noqa: E402
from cobatch.quant.weight import QuantWeight  # noqa: E402

out_dir = Path(os.environ.get("OUT", "/tmp/out"))
ok = True
for fmt_name in ["q8_0", "q4_0", "q4_1", "q4_k", "q6_k"]:
    rows, cols = 48, 512
    fmt = format_of(fmt_name)
    packed = random_quantized(fmt.ggml_type, rows, cols, torch.Generator().manual_seed(0))
    w = QuantWeight(fmt, rows, cols, packed.cuda())
    pw = packed_weight.PackedWeight.from_quant(w, "cuda")
    ref_w = w.dequantize(torch.float32)
    try:
        dense = torch.full((rows, cols), float("nan"), dtype=torch.float16, device="cuda")
        qm.dequantize_planes(pw.planes, dense)
        d_err = ((dense.double() - ref_w.double()).norm() / ref_w.double().norm()).item()
        x = torch.randn(5, cols, generator=torch.Generator().manual_seed(1)).cuda().half()
        y = pw.matmul(x)
        ref = x.double() @ ref_w.double().T
        y_err = ((y.double() - ref).norm() / ref.norm()).item()
        print(f"{fmt_name}: fragment={pw.planes.fragment} plan={pw.plan.narrow} dequant rel_err {d_err:.2e} "
              f"gemv rel_err {y_err:.2e}", flush=True)
        if d_err > 1e-2 or y_err > 1e-2:
            ok = False
            torch.save({"got": dense.cpu(), "ref": ref_w.cpu(), "y": y.cpu(), "yref": ref.cpu()},
                       out_dir / f"probe-{fmt_name}.pt")
    except Exception as e:
        ok = False
        print(f"{fmt_name}: FAILED {type(e).__name__}: {str(e)[:2000]}", flush=True)
sys.exit(0 if ok else 1)
