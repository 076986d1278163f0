"""A compiled kernel's hot loop, read on the CPU: registers, stack, and the instruction mix of the longest loop in
its sm_90 SASS (Triton's own ptxas and nvdisasm; no GPU).

    PYTHONPATH=src python bench/sass_loop.py [--list] [--dump DIR] WORD...
    PYTHONPATH=src python bench/sass_loop.py --plans [--model-shape qwen2.5-7b [--formats q8_0,q4_k,q6_k]]
    PYTHONPATH=src python bench/sass_loop.py --cuda [WORD...]

The variants are tests/sm90_variants.py's, every one the package can launch; WORDs pick those whose names hold
all of them (e.g. `decode single_split=True fp8`). --plans compiles instead every GEMV config that
quant_configs.json's plans launch, for their own formats and for those that borrow them (each tier at its token
tile, gate|up shapes with their act*mul epilogue, f16 activations as decode steps hand them over:
PackedWeight.operand_dtype) and names those that spill under their register budget; with --model-shape, every GEMV
call a model of that shape makes instead, on the plans or the defaults it gets; each with its loop's length in
instructions a warp, and those a weight and lane (32 x the length over the weights a warp's iteration dequantizes:
what a weight costs the SM's issue slots; COBATCH_GEMV_CLAMP_X=0 and COBATCH_GEMV_FOLD_STEPS=0 compile the plain
loops). --cuda reads the CUDA C++ kernels NVRTC compiles instead (cuda_variants(): MLA decode's with a bf16 cache and an fp8 one, its rows widened by
cvt or by bit moves). Counting a loop's instructions per iteration against the bytes it moves is how the fp8 KV
cache's single-byte shared-memory loads were found (docs/kernels.md); the stalls themselves need the GPU
(bench/ncu_source.py). Run without TRITON_INTERPRET (it makes @jit interpreted).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))   # `kernels` by name: its model shapes (--model-shape)
import kernels  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# an instruction line of nvdisasm's listing: /*0a10*/ [@!P0] OPCODE.MODIFIERS operands ;
INSTRUCTION = re.compile(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)")
LABEL = re.compile(r"^(\.L_x_\d+):")
BRANCH = re.compile(r"\bBRA\b.*`\((\.L_x_\d+)\)")


def longest_loop(sass: str) -> list[str]:
    """The instruction lines between the label and the backward branch of the longest loop (a BRA to a label
    above it); [] if there is none."""
    lines = sass.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := LABEL.match(line))}
    best = (0, 0, -1)
    for i, line in enumerate(lines):
        m = BRANCH.search(line)
        if m and labels.get(m.group(1), i) < i and i - labels[m.group(1)] > best[0]:
            best = (i - labels[m.group(1)], labels[m.group(1)], i)
    _, start, end = best
    return [line for line in lines[start:end + 1] if INSTRUCTION.match(line)]


def opcode_mix(lines: list[str], modifiers: bool = False) -> Counter:
    """Instructions by opcode (LDS.U8 and LDS.128 apart with modifiers, both LDS without)."""
    ops = (INSTRUCTION.match(line).group(1) for line in lines)
    return Counter(op if modifiers else op.split(".")[0] for op in ops)


def disassemble(cubin: bytes) -> str:
    import triton
    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True, check=True).stdout


def plan_gemv_launches(table: dict, borrowed: bool = False) -> list[tuple[str, dict, int]]:
    """(label, the GEMV kernel's constants, register budget) of every GEMV call quant_configs.json's plans make:
    each "gemv_upto" tier at 8-token tiles (16 past 8 tokens), and "gemv" at 16 and, without a tier up to 8
    tokens, at 8 too (a shape's GEMM may take the 16-token calls: compiled anyway; a routed GEMV's slots are
    8 or 16 pairs as well). With `borrowed`, also the calls a format makes on the plans it borrows
    (matmul_plans.PLANS_LIKE: NVFP4 on q4_K's, FP8 on q8_0's, ...) where it has no GEMV plan of its own: the same
    config runs another decode, whose registers differ."""
    from cobatch.kernels import matmul_plans
    formats = table["formats"]
    entries = [(fmt_name, shape, entry, "") for fmt_name, fmt_table in formats.items()
               for shape, entry in fmt_table.get("shapes", {}).items()]
    if borrowed:
        entries += [(borrower, shape, entry, f" (as {lender})")
                    for borrower, lender in matmul_plans.PLANS_LIKE.items()
                    for shape, entry in formats.get(lender, {}).get("shapes", {}).items()
                    if "gemv" not in formats.get(borrower, {}).get("shapes", {}).get(shape, {})]
    return [launch for fmt_name, shape, entry, note in entries if "gemv" in entry
            for launch in _entry_launches(fmt_name, shape, entry, note)]


def _entry_launches(fmt_name: str, shape: str, entry: dict, note: str) -> list[tuple[str, dict, int]]:
    from cobatch.kernels import matmul_plans
    return _gemv_plan_launches(f"{fmt_name}{note} {shape}", fmt_name, matmul_plans.table_gemv_plan(entry),
                               matmul_plans.gemv_chunks(fmt_name, _cols_pad(int(shape.split("x")[1]))),
                               int(shape in GATE_UP_SHAPES), shape in ROUTED_SHAPES)


def _cols_pad(cols: int) -> int:
    """K as a weight's planes hold it: padded to quant_pack.COL_PAD (K = 1408 takes 24 K steps of 64, not 22)."""
    from cobatch.kernels import quant_pack
    return -(-cols // quant_pack.COL_PAD) * quant_pack.COL_PAD


def _gemv_plan_launches(label: str, fmt_name: str, plan, n_chunks: int, act: int,
                        routed: bool) -> list[tuple[str, dict, int]]:
    """(label, constants, register budget) of each call a GEMV plan makes: each tier at 8-token tiles (16 past 8
    tokens), the default at 16 and, without a tier up to 8 tokens, at 8 too; with the tail a config's U leaves."""
    from cobatch.kernels import quant_gemv, quant_pack
    fmt = quant_pack.fragment_layout(quant_pack.PACKED_FORMATS[fmt_name])
    calls = [(f"upto {n}", c, 8 if n <= 8 else 16) for n, c in plan.upto] + [("gemv", plan.default, 16)]
    if not any(n >= 8 for n, _ in plan.upto):
        calls.append(("gemv", plan.default, 8))
    launches = []
    for tier, c, bt in calls:
        constants = dict(FMT=fmt, W=c.W, RT=c.RT, BT=bt, SPLIT_K=c.split_k, X_LOADS=quant_gemv.x_loads(True), U=c.U,
                         D=c.D, ROUTED=routed, ACT=act, PDL=bt == 8, TAIL=quant_gemv.warp_steps(n_chunks, c) % c.U,
                         FOLD=quant_gemv.folds_steps(c))
        launches.append((f"{label} {tier} bt={bt}", constants, c.R or None))
    return launches


def model_gemv_launches(model_shape: str, formats: list[str]) -> list[tuple[str, dict, int]]:
    """(label, constants, register budget) of every GEMV call a model of that `cobatch make-model --shape` makes in
    each of `formats`: its q|k|v, o, gate|up (with the act*mul epilogue), down, k or v alone and head, each on the
    plan it would get at load (the table's, a lender's or matmul_plans.default_gemv_plan)."""
    from cobatch.kernels import matmul_plans
    launches = []
    for fmt_name in formats:
        for name, (rows, cols) in kernels.model_shapes(model_shape).items():
            cols_pad = _cols_pad(cols)
            plan = matmul_plans.plan_for(fmt_name, rows, cols, cols_pad, gemv=True).narrow
            launches += _gemv_plan_launches(f"{fmt_name} {model_shape} {name} {rows}x{cols}", fmt_name, plan,
                                            matmul_plans.gemv_chunks(fmt_name, cols_pad), int(name == "gate_up"),
                                            False)
    return launches


# How quant_configs.json's shapes run beyond a plain GEMV: gate|up with the act*mul epilogue (Llama-3-8B's;
# DeepSeek-V2-Lite's shared experts'), routed over stacked experts (V2-Lite's routed down), or both (its routed
# gate|up)
GATE_UP_SHAPES = {"28672x4096", "5632x2048", "2816x2048"}
ROUTED_SHAPES = {"2816x2048", "2048x1408"}


def cuda_variants() -> dict[str, tuple[str, str]]:
    """name -> (CUDA C++ source, kernel name) of the NVRTC kernels --cuda reads: MLA decode's split kernel at
    DeepSeek's latent shapes (512 + 64, 64-row cache blocks, splits, PDL) on its default rings."""
    from cobatch.kernels import mla_decode_cuda as mla
    cfg = mla.MLA_CUDA_CONFIG
    variants = {"mla cuda bf16": (cfg, False), "mla cuda fp8": (cfg, True),
                "mla cuda fp8 out_bits": (mla.MlaCudaConfig(out_bits=True), True)}
    return {name: (mla.source(c, 512, 64, 64, False, True, True, 64, fp8), "mla_decode")
            for name, (c, fp8) in variants.items()}


def read_cuda(words: list[str], list_only: bool, dump: Path | None) -> None:
    """--cuda: each picked NVRTC kernel's registers (ptxas's report) and its longest loop's instruction mix."""
    from cobatch.kernels import nvrtc
    if not nvrtc.available():
        fail("NVRTC is not installed (pip install nvidia-cuda-nvrtc)")
    picked = {name: v for name, v in cuda_variants().items() if all(w in name for w in words)}
    if not picked:
        fail(f"no CUDA variant's name holds all of {words} (--cuda --list shows them)")
    for name, (source, kernel) in picked.items():
        if list_only:
            print(name)
            continue
        cubin, log = nvrtc.compile_cubin(source, kernel, "90a", ("--ptxas-options=-v",))
        sass = disassemble(cubin)
        if dump:
            dump.mkdir(parents=True, exist_ok=True)
            (dump / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".sass")).write_text(sass)
        usage = " ".join(line.split(":", 1)[-1].strip() for line in log.splitlines() if "Used" in line)
        loop = longest_loop(sass)
        print(f"{name}\n  {usage}; longest loop: {len(loop)} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in opcode_mix(loop, modifiers=True).most_common(16)))


def fail(why: str) -> None:
    print(f"bench/sass_loop.py: {why}", file=sys.stderr)
    sys.exit(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("words", nargs="*", help="pick the variants whose names hold all of these")
    ap.add_argument("--list", action="store_true", help="print the picked variants' names only")
    ap.add_argument("--dump", type=Path, help="write each variant's SASS to DIR")
    ap.add_argument("--plans", action="store_true", help="every GEMV config of quant_configs.json's plans: spills")
    ap.add_argument("--cuda", action="store_true", help="the CUDA C++ kernels NVRTC compiles (cuda_variants())")
    ap.add_argument("--model-shape", help="with --plans: the GEMV calls a model of this `cobatch make-model --shape` "
                                          "makes instead (its plans or the defaults)")
    ap.add_argument("--formats", default="q8_0,q4_k,q6_k", help="with --model-shape: these formats")
    args = ap.parse_args()
    if args.cuda:
        read_cuda(args.words, args.list, args.dump)
        return
    if os.environ.get("TRITON_INTERPRET") == "1":
        fail("unset TRITON_INTERPRET (it makes @jit interpreted, and nothing compiles)")
    sys.path.insert(0, str(ROOT / "tests"))
    import sm90_variants
    if args.plans:
        import json
        from cobatch.kernels import matmul_plans, quant_gemv
        table = json.loads(matmul_plans.CONFIG_PATH.read_text())
        launches = (model_gemv_launches(args.model_shape, args.formats.split(",")) if args.model_shape
                    else plan_gemv_launches(table, borrowed=True))
        for label, constants, budget in launches:
            compiled = sm90_variants.compile_gluon_for_h200(quant_gemv._gemv_kernel, constants, constants["W"],
                                                            budget, activations="fp16")
            regs, stack = sm90_variants.registers(compiled)
            loop = longest_loop(disassemble(compiled.asm["cubin"]))
            weights = constants["U"] * constants["RT"] * 16 * (32 if quant_gemv._byte_fmt_of(constants["FMT"]) else 64)
            print(f"{'SPILLS' if stack else 'ok':>6} {regs:>3} registers, {stack:>3} bytes of stack, loop "
                  f"{len(loop):>4} instructions, {32 * len(loop) / weights:.2f} a weight and lane: {label}")
        return
    jobs = [job for job in sm90_variants.jobs if all(w in job[0] for w in args.words)]
    if not jobs:
        fail(f"no variant's name holds all of {args.words} (--list shows them)")
    for name, compile_variant, variant_args in jobs:
        if args.list:
            print(name)
            continue
        compiled = compile_variant(*variant_args)
        sass = disassemble(compiled.asm["cubin"])
        if args.dump:
            args.dump.mkdir(parents=True, exist_ok=True)
            (args.dump / (re.sub(r"[^A-Za-z0-9_.=-]+", "_", name) + ".sass")).write_text(sass)
        regs, stack = sm90_variants.registers(compiled) or (None, None)
        loop = longest_loop(sass)
        print(f"{name}\n  {regs} registers, {stack} bytes of stack; longest loop: {len(loop)} instructions")
        print("  " + ", ".join(f"{op} {n}" for op, n in opcode_mix(loop, modifiers=True).most_common(16)))


if __name__ == "__main__":
    main()
