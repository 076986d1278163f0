"""The GPU benchmark scripts import on the CPU (a stale config knob once broke one at import, which cost a
device call), bench/device.sh parses and knows its suites, and the GEMV plan choice of bench/kernels.py keeps
batch invariance."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cobatch.kernels.quant_gemv import GemvConfig

ROOT = Path(__file__).resolve().parents[1]


# The bench scripts import each other by plain name (from kernels import ..., from timing import ...), as
# `python bench/X.py` resolves them. In a test process another module of such a name may be loaded already:
# transformers imports Hugging Face's `kernels` package.
BENCH_SIBLINGS = [p.stem for p in (ROOT / "bench").glob("*.py")]


def load(name: str):
    """bench/NAME.py as a module, its sibling imports resolved to bench/ whatever this process loaded before.
    The scripts put bench/ on sys.path; it is taken off again, or a later `import kernels` (transformers looks
    for Hugging Face's package of that name) would find bench/kernels.py in every test after this one."""
    saved = {n: sys.modules.pop(n) for n in BENCH_SIBLINGS if n in sys.modules}
    saved_path = list(sys.path)
    try:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module          # dataclasses look their module up while it executes
        spec.loader.exec_module(module)
    finally:
        for n in BENCH_SIBLINGS:     # what this process had under those names comes back
            sys.modules.pop(n, None)
        sys.modules.update(saved)
        sys.path[:] = saved_path
    return module


@pytest.mark.parametrize("name", ["kernels", "kernels_attention", "decode", "size_ceiling", "gemv_ab", "plot",
                                  "gemv_configs", "moe_decode", "moe_experts", "speculative", "parallel", "ncu_source",
                                  "gemm", "plan_ab", "serve", "model_gemv_plans", "sass_loop", "sampler",
                                  "prefill_host", "step_phases"])
def test_bench_script_imports(name):
    module = load(name)
    assert callable(getattr(module, "main", None)), name


def test_gemv_configs_parses_its_config_list():
    parse = load("gemv_configs").parse_configs
    assert parse("4,8,1,1,0;2,4,2,4,2,128") == [GemvConfig(W=4, RT=8, split_k=1, U=1, D=0),
                                                 GemvConfig(W=2, RT=4, split_k=2, U=4, D=2, R=128)]
    for bad in ("4,8,1", "4,8,1,1,0,128,7"):
        with pytest.raises(ValueError):
            parse(bad)


def test_best_gemv_plan_keeps_one_k_split_and_picks_per_tier():
    kernels = load("kernels")
    one = GemvConfig(W=4, RT=1, split_k=2, U=8)      # fastest alone at 1 token
    mid = GemvConfig(W=4, RT=2, split_k=2, U=4)
    wide = GemvConfig(W=4, RT=4, split_k=2, D=2)
    other = GemvConfig(W=8, RT=1, split_k=2, U=4)    # another K split: faster at 1 token, slow elsewhere
    timed = [({1: 10, 4: 12, 8: 20, 16: 30}, one), ({1: 12, 4: 11, 8: 15, 16: 25}, mid),
             ({1: 14, 4: 13, 8: 16, 16: 22}, wide), ({1: 9, 4: 20, 8: 30, 16: 40}, other)]
    plan = kernels.best_gemv_plan(timed)
    assert plan.default == wide and plan.upto == ((1, one), (8, mid))
    assert {(c.W, c.split_k) for c in plan.configs()} == {(4, 2)}
    assert kernels.best_gemv_plan([({1: 1, 4: 1, 8: 1, 16: 1}, one)]).upto == ()


def test_table_from_result_reproduces_a_runs_gemv_plans():
    kernels = load("kernels")
    plan = {"default": {"W": 4, "RT": 4, "split_k": 2, "U": 1, "D": 0},
            "upto": {"8": {"W": 4, "RT": 1, "split_k": 2, "U": 8, "D": 0}}}
    result = {"rows": [
        {"kind": "gemv", "fmt": "q4_1", "rows": 4096, "cols": 4096, "n_tok": 1, "crossover": 64, "narrow": plan},
        {"kind": "gemv", "fmt": "q8_0", "rows": 4096, "cols": 4096, "n_tok": 1, "crossover": 32,
         "narrow": {"default": plan["default"], "upto": {}}},
        {"kind": "gemm", "fmt": "q4_1", "rows": 4096, "cols": 4096, "n_tok": 512}]}
    table = {"formats": {"q8_0": {"shapes": {"4096x4096": {"narrow": "kept", "gemv_upto": {"1": {}}}}}}}
    out = kernels.table_from_result(result, table)
    q41 = out["formats"]["q4_1"]["shapes"]["4096x4096"]
    assert q41 == {"gemv": plan["default"], "gemv_crossover": 64, "gemv_upto": plan["upto"]}
    q80 = out["formats"]["q8_0"]["shapes"]["4096x4096"]
    assert q80 == {"narrow": "kept", "gemv": plan["default"], "gemv_crossover": 32}   # stale tiers dropped


def test_gemv_ab_table_takes_each_trees_best_round():
    gemv_ab = load("gemv_ab")
    row = lambda us, pct: {"fmt": "q4_1", "shape": "o", "n_tok": 1, "us": us, "pct_copy": pct, "rel_err": 1e-4}
    results = {"old": [{"rows": [row(10.0, 20.0)]}, {"rows": [row(8.0, 25.0)]}],
               "new": [{"rows": [row(4.0, 50.0)]}, {"rows": [row(5.0, 40.0)]}]}
    line = gemv_ab.table(results).splitlines()[-1]
    assert line == "| q4_1 | o | 1 | 25.0 | 50.0 | 0.500 | 1.0e-04 |"


DEVICE_SH = ROOT / "bench" / "device.sh"


def test_device_sh_parses_and_lists_its_suites():
    assert subprocess.run(["bash", "-n", str(DEVICE_SH)]).returncode == 0
    usage = subprocess.run(["bash", str(DEVICE_SH)], capture_output=True, text=True)
    assert usage.returncode == 2
    for suite in ("tests", "kernels", "decode", "serve", "moe", "ab OLD NEW"):
        assert f"\n  {suite} " in "\n" + usage.stdout, suite
    # every suite the usage lists has its branch in the script
    listed = [line.split()[0] for line in usage.stdout.splitlines() if line.startswith("  ") and line[2] != " "]
    script = DEVICE_SH.read_text()
    assert listed and all(f"\n{suite})" in script for suite in listed), listed
    # and the check that refuses unknown suites accepts it
    accepted = " ".join(re.findall(r'SUITES\+?="([^"]*)"', script)).split()
    assert sorted(set(listed) - set(accepted)) == []


def test_device_sh_runs_every_test_file_with_gpu_tests():
    """Each test file with CUDA tests is in GPU_TEST_FILES (the `tests` suite's default) or run by a suite of its
    own, so no GPU test goes unrun on the device."""
    script = DEVICE_SH.read_text()
    default = re.search(r"GPU_TEST_FILES=\((.*?)\)", script, re.S).group(1).split()
    run_by_suites = set(re.findall(r"run_tests[^\n]*?(tests/test_\w+\.py)", script))
    with_gpu_tests = {f"tests/{path.name}" for path in sorted((ROOT / "tests").glob("test_*.py"))
                      if re.search(r"@requires_(cuda|hopper)\b", path.read_text())}
    assert with_gpu_tests and with_gpu_tests <= set(default) | run_by_suites, \
        sorted(with_gpu_tests - set(default) - run_by_suites)


def test_device_sh_refuses_an_unknown_suite_before_touching_the_machine(tmp_path):
    run = subprocess.run(["bash", str(DEVICE_SH), "benchmarks"], capture_output=True, text=True,
                         env={**os.environ, "OUT": str(tmp_path / "out")})
    assert run.returncode == 2 and "unknown suite 'benchmarks'" in run.stderr
    assert not (tmp_path / "out").exists()


def test_plot_draws_every_point_of_the_results(tmp_path):
    plot = load("plot")
    decode = {"date": "d", "device": "GPU", "models": [{"model": "/m.gguf", "decode": [
        {"context": 512, "batch": b, "tok_s": 100.0 * b} for b in (1, 2, 4)] + [
        {"context": 4096, "batch": b, "tok_s": 50.0 * b} for b in (1, 2, 4)]}]}
    serve = {"config": {"prompt_tokens": 128}, "levels": [{"clients": 1, "steady_tok_s": 90.0},
                                                            {"clients": 4, "steady_tok_s": 380.0}]}
    (tmp_path / "decode.json").write_text(json.dumps(decode))
    (tmp_path / "serve.json").write_text(json.dumps(serve))
    out = tmp_path / "plot.svg"
    assert plot.main(["--decode", str(tmp_path / "decode.json"), "--serve", str(tmp_path / "serve.json"),
                      "-o", str(out)]) == 0
    text = out.read_text()
    assert text.count("<polyline") == 3 and text.count("<circle") == 8
    assert "engine, ctx 512" in text and "engine, ctx 4096" in text and "HTTP streaming clients" in text


def test_gemv_sweep_screen_keeps_the_fastest_and_every_k_split():
    """bench/kernels.py's screen: the fastest 30 % by their 1- and 16-token times, and the fastest config of each
    (W, split_k) group however slow, so the plan choice still sees every way of splitting K."""
    kernels = load("kernels")
    cands = [GemvConfig(W=4, RT=rt, split_k=1, U=u) for rt in (1, 2, 4) for u in (1, 2, 4)]
    cands += [GemvConfig(W=8, RT=1, split_k=2, U=1), GemvConfig(W=8, RT=2, split_k=2, U=1)]
    screen = {c: {1: 10.0 + i, 16: 20.0 + 2 * i} for i, c in enumerate(cands)}      # slower down the list
    kept = kernels.gemv_survivors(screen)
    assert kept == cands[:3] + [cands[9]]


def test_gemm_config_keys_round_trip():
    """bench/gemm.py names each config in its JSON (config_key) and reads the names back (config_of): every
    sweep candidate, and rings with LAG and AHEAD, come back as themselves."""
    gemm = load("gemm")
    rows, cols = gemm.SHAPES["gate_up"]
    ring = gemm.GemmConfig(8, 1, RING=4, CHUNKS=4, APART=True, PERSIST=1, LAG=True, AHEAD=True)
    for c in gemm.candidates(rows, cols // 32) + [ring, gemm.GemmConfig(4, 2, RING=6, CHUNKS=4, AHEAD=True)]:
        assert gemm.config_of(gemm.config_key(c)) == c, c
    assert gemm.config_of("8,1,0,0,0,4,4,apart,persist1,lag,ahead") == ring
    assert gemm.config_of("8,2,0,1,0,0,1") == gemm.GemmConfig(8, 2, P=True)      # an older sweep's name


def test_model_shapes_give_a_models_matrices():
    """--model-shape times another make-model shape's matrices: for llama3-8b they are the benchmarks' own (and
    bench/gemm.py's k or v alone); Qwen2.5-0.5B's are written from its config (14 heads of 64, 2 KV heads)."""
    kernels, gemm = load("kernels"), load("gemm")
    llama = kernels.model_shapes("llama3-8b")
    assert {k: v for k, v in llama.items() if k != "kv"} == kernels.SHAPES and llama["kv"] == gemm.SHAPES["kv"]
    assert kernels.model_shapes("qwen2.5-0.5b") == {
        "qkv": (1152, 896), "o": (896, 896), "gate_up": (9728, 896), "down": (896, 4864), "kv": (128, 896),
        "lm_head": (151936, 896)}
    with pytest.raises(SystemExit):
        kernels.model_shapes("deepseek-v2-lite")       # MLA: not these matrices
    table = dict(gemm.SHAPES)
    kernels.use_model_shapes(table, "qwen2.5-0.5b", with_kv=False)
    assert table["o"] == (896, 896) and "kv" not in table


def test_gemm_choice_hands_9_to_16_tokens_to_the_gemm_where_it_beat_the_gemv_at_16():
    """bench/gemm.py's choose: the GEMM's 16-token tile faster than the GEMV at 16 tokens takes the crossover down
    to the GEMV's 8-token tier; slower, the GEMV keeps 16 (and more, while it still wins)."""
    gemm = load("gemm")
    c = gemm.GemmConfig(8, 4, RING=4, CHUNKS=4, LAG=True)
    toks = [16, 32, 64, 128, 256]

    def rows(gemv_us):
        return {n: {"old_path": "gemv" if n <= 64 else "dequant+cublas", "old_us": gemv_us[n],
                    "dequant_cublas_us": 500.0} for n in toks}
    times = {(c, n): us for n, us in zip(toks, (23.6, 25.0, 29.5, 39.8, 67.8))}
    faster = gemm.choose([c], times, rows({16: 31.6, 32: 50.3, 64: 90.3, 128: 128.1, 256: 137.8}), toks)
    assert faster["quant_gemm_crossover"] == 8 and faster["quant_gemm_upto"] == 256
    slower = gemm.choose([c], times, rows({16: 22.0, 32: 24.0, 64: 90.3, 128: 128.1, 256: 137.8}), toks)
    assert slower["quant_gemm_crossover"] == 32


def test_ncu_source_sums_stalls_by_reason_without_the_idle_warps(tmp_path):
    """A hand-made source page: the NOP where idle warps wait counts in the opcode shares, not in the reasons."""
    csv = tmp_path / "source.csv"
    csv.write_text('==PROF== a note\n"Kernel Name","_k",\n'
                   '"Address","Source","Warp Stall Sampling (All Samples)","stall_barrier","stall_long_sb",'
                   '"stall_barrier (Not Issued)"\n'
                   '"0x10","      NOP","100","100","0","90"\n'
                   '"0x20","  @!P0  BRA 0x10","30","0","30","0"\n'
                   '"0x30","      BAR.SYNC 0x0","10","10","0","0"\n')
    out = subprocess.run(["python3", str(ROOT / "bench" / "ncu_source.py"), str(csv), "2"], capture_output=True,
                         text=True, check=True).stdout.splitlines()
    assert out[0] == "3 instructions, 140 stall samples"
    assert out[1].startswith("by opcode: NOP 71.4%, BRA 21.4%, BAR 7.1%")
    assert out[2] == "stall reasons but at NOPs: long_sb 75.0%, barrier 25.0%"
    assert [line.split()[0] for line in out[3:]] == ["0x10", "0x20"]     # the top 2, in address order


def test_plan_ab_ring_depth_tables_change_only_the_ring_depths(tmp_path):
    plan_ab = load("plan_ab")
    ring = {"NW": 4, "split_k": 2, "RING": 4, "CHUNKS": 2, "LAG": True}
    table = {"formats": {
        "q4_k": {"shapes": {"4096x4096": {"gemv": {"W": 4}, "quant_gemm": dict(ring), "quant_gemm_wide": dict(ring)},
                            "128256x4096": {"quant_gemm": {"NW": 4, "split_k": 1, "P": True, "TMA": 0}}}},
        "q8_0": {"shapes": {"4096x4096": {"quant_gemm": dict(ring)}}}}}
    out = plan_ab.ring_depth_table(table, "q4_k", 8)
    o = out["formats"]["q4_k"]["shapes"]["4096x4096"]
    assert o["quant_gemm"] == {**ring, "RING": 8} and o["quant_gemm_wide"] == {**ring, "RING": 8}
    assert o["gemv"] == {"W": 4}
    assert out["formats"]["q4_k"]["shapes"]["128256x4096"] == table["formats"]["q4_k"]["shapes"]["128256x4096"]
    assert out["formats"]["q8_0"] == table["formats"]["q8_0"] and table["formats"]["q4_k"]["shapes"][
        "4096x4096"]["quant_gemm"]["RING"] == 4          # the input is left as it was
    paths = plan_ab.variant_tables("q6_k=4,6", tmp_path, "ring")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["q6_k-ring4.json", "q6_k-ring6.json"]
    six = json.loads(open(paths[1]).read())["formats"]["q6_k"]["shapes"]
    assert any(e.get("quant_gemm", {}).get("RING") == 6 for e in six.values())
    assert all(e["quant_gemm"]["RING"] == 6 for e in six.values() if e.get("quant_gemm", {}).get("RING"))


def test_plan_ab_knockouts_stand_in_for_their_kernels_and_put_them_back():
    """--knockout's stand-ins take the real ops' arguments and hand on what the next op accepts (a wrong shape would
    show only on the device, in a call), and the real ops come back after."""
    from cobatch import ops
    from cobatch.engine.sampler import SamplingParams
    from cobatch.kernels import attention
    from model_fixtures import load_llm
    plan_ab = load("plan_ab")
    real = (ops.rms_norm, ops.rope_attention, attention._decode_reduce_kernel)
    llm = load_llm("smollm2")
    ids = llm.encode_prompt("The capital of France is")
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True)
    plain = llm.engine.generate([ids], params)
    for name, patches in plan_ab.KNOCKOUTS.items():
        with plan_ab.knocked_out(name):
            assert all(getattr(importlib.import_module(m), a) is stand_in for m, a, stand_in in patches)
            (tokens,) = llm.engine.generate([ids], params)
        assert len(tokens) == 3 and all(0 <= t < llm.config.vocab_size for t in tokens), (name, tokens)
    assert (ops.rms_norm, ops.rope_attention, attention._decode_reduce_kernel) == real
    assert llm.engine.generate([ids], params) == plain


def test_plan_ab_gemm_from_tables_move_only_the_gemm_crossover(tmp_path):
    plan_ab = load("plan_ab")
    table = {"formats": {"q8_0": {"shapes": {
        "4096x4096": {"gemv": {"W": 4}, "quant_gemm": {"NW": 4}, "quant_gemm_crossover": 8},
        "1024x4096": {"gemv": {"W": 2}}}}}}
    out = plan_ab.gemm_from_table(table, "q8_0", 0)["formats"]["q8_0"]["shapes"]
    assert out["4096x4096"] == {"gemv": {"W": 4}, "quant_gemm": {"NW": 4}, "quant_gemm_crossover": 0}
    assert out["1024x4096"] == {"gemv": {"W": 2}}          # no GEMM plan: the GEMV keeps every call
    assert table["formats"]["q8_0"]["shapes"]["4096x4096"]["quant_gemm_crossover"] == 8
    paths = plan_ab.variant_tables("q8_0=0,4", tmp_path, "gemm-from")
    assert [p.rsplit("/", 1)[-1] for p in paths] == ["q8_0-gemm-from0.json", "q8_0-gemm-from4.json"]
    # one table entry only (the package's: q4_K qkv's and o's both have GEMM plans)
    path, = plan_ab.variant_tables("q4_k:6144x4096=24", tmp_path, "gemm-from")
    assert path.rsplit("/", 1)[-1] == "q4_k-6144x4096-gemm-from24.json"
    shapes = json.loads(open(path).read())["formats"]["q4_k"]["shapes"]
    package = json.loads(open(plan_ab.PACKAGE_TABLE).read())["formats"]["q4_k"]["shapes"]
    assert shapes["6144x4096"]["quant_gemm_crossover"] == 24 != package["6144x4096"]["quant_gemm_crossover"]
    others = [k for k in package if k != "6144x4096"]
    assert others and all(shapes[k] == package[k] for k in others)
    with pytest.raises(SystemExit):
        plan_ab.variant_tables("q4_k:5x7=16", tmp_path, "gemm-from")


def test_plan_ab_without_gemv_tables_drop_only_those_formats_gemv_plans():
    plan_ab = load("plan_ab")
    table = {"formats": {
        "q8_0": {"shapes": {"4096x4096": {"gemv": {"W": 4}, "gemv_upto": {"8": {"W": 4}}, "gemv_crossover": 64,
                                          "quant_gemm": {"NW": 4}}}},
        "q4_k": {"shapes": {"4096x4096": {"gemv": {"W": 2}}}}}}
    out = plan_ab.without_gemv_table(table, ["q8_0"])["formats"]
    assert out["q8_0"]["shapes"]["4096x4096"] == {"gemv_crossover": 64, "quant_gemm": {"NW": 4}}
    assert out["q4_k"] == table["formats"]["q4_k"]
    assert "gemv" in table["formats"]["q8_0"]["shapes"]["4096x4096"]      # the table given is not changed


def test_plan_ab_switch_sets_a_kernel_module_attribute_and_puts_it_back():
    plan_ab = load("plan_ab")
    from cobatch.kernels import quant_gemm
    assert plan_ab.parse_switch("quant_gemm.PAD_X_TO_TILE=0,1") == [[("quant_gemm", "PAD_X_TO_TILE", 0)],
                                                                    [("quant_gemm", "PAD_X_TO_TILE", 1)]]
    both = plan_ab.parse_switch("quant_gemm.PAD_X_TO_TILE=0&quant_gemv.GEMV_CLAMP_X=0")
    assert both == [[("quant_gemm", "PAD_X_TO_TILE", 0), ("quant_gemv", "GEMV_CLAMP_X", 0)]]
    from cobatch.kernels import quant_gemv
    before, clamp_before = quant_gemm.PAD_X_TO_TILE, quant_gemv.GEMV_CLAMP_X
    with plan_ab.switched(both[0]):
        assert quant_gemm.PAD_X_TO_TILE is False            # cast to the switch's own type
        assert quant_gemv.GEMV_CLAMP_X is False
    assert quant_gemm.PAD_X_TO_TILE is before and quant_gemv.GEMV_CLAMP_X is clamp_before
    with pytest.raises(SystemExit):
        with plan_ab.switched([("quant_gemm", "NO_SUCH_SWITCH", 1)]):
            pass


def test_moe_experts_times_the_routed_gemm_only_where_a_layer_runs_it_and_puts_its_switches_back():
    """bench/moe_experts.py: expert by expert and the routed slices at every row count; the routed GEMM's configs
    times slot caps only where the layer runs it, with two warpgroups only on stacks of whole 128-row blocks; each
    way's switches (and a stack's GEMM config) are put back after it."""
    from types import SimpleNamespace as NS

    from cobatch.kernels import packed_experts
    from cobatch.models import moe as moe_module
    moe_experts = load("moe_experts")
    # q4_K's planes are q4_1's: 2048 columns are 32 chunks, and 64-weight chunks hold 512 bytes of a 16-row tile
    q4_k = NS(fmt_id=moe_experts.quant_gemm.quant_pack.Q4_1, qs=torch.empty(0, 32 * 512))
    stacks = (NS(rows=2816, routed_gemm="planned", routed_gemm_wide="wide", planes=q4_k),
              NS(rows=2048, routed_gemm="planned", routed_gemm_wide="wide", planes=q4_k))
    layer = NS(routed_gemm=True, routed_gate_up=stacks[0], routed_down=stacks[1],
               _gemm_slots=lambda n_rows: packed_experts.ROUTED_GEMM and n_rows > 256)
    assert [name for name, _, _ in moe_experts.ways(layer, 64)] == ["expert by expert", "routed slices"]
    names = [name for name, _, _ in moe_experts.ways(layer, 2048)]
    assert names[:3] == ["expert by expert", "routed slices", "routed GEMM as planned"]
    assert "routed GEMM plain NW=8 P=1 slots<=128" in names
    assert "routed GEMM ring NW=8 8x2 lag ahead persist slots<=64" in names
    # every config at every slot cap, but rings whose stages do not fit twice at 128-token tiles
    gemm = moe_experts.quant_gemm
    fits = [(c, m) for c in moe_experts.GEMM_CONFIGS for m in moe_experts.MAX_SLOTS
            if not c.RING or gemm.ring_stages(c, q4_k.fmt_id, m) >= 2]
    assert len(names) == 3 + len(fits) and len(fits) > 4 * 3
    stacks[1].rows = 2112          # 33 blocks of 64 rows: one warpgroup a CTA only
    assert {name.split()[3] for name, _, _ in moe_experts.ways(layer, 2048)[3:]} == {"NW=4"}
    stacks[1].planes = NS(fmt_id=q4_k.fmt_id, qs=torch.empty(0, 12 * 512))    # Qwen3-30B-A3B's down: 768 columns
    assert not any("x4" in name for name, _, _ in moe_experts.ways(layer, 2048))   # 4-chunk stages: 8 an iteration

    def switches():
        return (moe_module.ROUTED_PREFILL, packed_experts.ROUTED_GEMM, packed_experts.ROUTED_MAX_ROWS,
                packed_experts.ROUTED_GEMM_MAX_SLOT, [(s.routed_gemm, s.routed_gemm_wide) for s in stacks])

    before = switches()
    for name, way, _ in moe_experts.ways(layer, 2048):
        with way:
            if name == "routed GEMM as planned":
                assert packed_experts.ROUTED_GEMM and stacks[0].routed_gemm == "planned"
            elif name.startswith("routed GEMM"):
                assert packed_experts.ROUTED_GEMM and stacks[0].routed_gemm.NW == 4
                assert stacks[0].routed_gemm_wide is stacks[0].routed_gemm
                assert packed_experts.ROUTED_GEMM_MAX_SLOT == int(name.rsplit("<=", 1)[1])
            elif name == "expert by expert":
                assert packed_experts.ROUTED_MAX_ROWS == 0 and not packed_experts.ROUTED_GEMM
            else:
                assert moe_module.ROUTED_PREFILL and not packed_experts.ROUTED_GEMM
        assert switches() == before, name


def test_serve_stub_engine_answers_through_the_real_app():
    """bench/serve.py --stub-step-ms: the stub engine behind the real server answers streamed and plain requests
    and /metrics (it once fell behind the engine's outputs and the scheduler's fields, and every request was a
    500)."""
    import types
    from starlette.testclient import TestClient
    from cobatch.model_files import smollm2_path
    serve = load("serve")
    args = types.SimpleNamespace(model=str(smollm2_path()), stub_step_ms=0.5, stub_host_ms=0.1, parallel=4, ctx=None,
                                 rounds=1)
    with TestClient(serve.make_app(args)) as client:
        plain = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 5})
        assert plain.status_code == 200 and plain.json()["usage"]["completion_tokens"] == 5
        streamed = client.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 3, "stream": True,
                                                        "logprobs": 0})
        assert streamed.status_code == 200
        # a slow reader may get several tokens in one event: count the tokens the events' logprobs name
        events = [json.loads(line[6:]) for line in streamed.text.splitlines()
                  if line.startswith("data: {")]
        assert sum(len((c["logprobs"] or {}).get("tokens", [])) for e in events for c in e["choices"]) == 3
        assert client.get("/metrics").status_code == 200


def test_model_gemv_plans_entries_read_back_as_the_plans_chosen(tmp_path, monkeypatch):
    """bench/model_gemv_plans.py writes each chosen plan as a table entry ("gemv", and "gemv_upto" keyed by the tier's
    token bound): loaded through plan_for, the entry gives the same plan back, tiers and all."""
    from cobatch.kernels import matmul_plans
    from cobatch.kernels.quant_gemv import GemvPlan
    plan = GemvPlan(GemvConfig(W=2, RT=4, split_k=11, U=2, D=0, R=0),
                    ((1, GemvConfig(W=2, RT=4, split_k=11, U=2)), (8, GemvConfig(W=2, RT=4, split_k=11, U=2, R=128))))
    entry = load("model_gemv_plans").entry_of(plan)
    assert json.loads(json.dumps(entry)) == entry        # the table is JSON: tier bounds become strings
    path = tmp_path / "table.json"
    path.write_text(json.dumps({"formats": {"q6_k": {"shapes": {"2048x2816": entry}}}}))
    monkeypatch.setenv("COBATCH_QUANT_CONFIGS", str(path))
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)     # the interpreter's plans ignore the tables
    assert matmul_plans.plan_for("q6_k", 2048, 2816, 2816, gemv=True).narrow == plan
    single = GemvPlan(GemvConfig(W=4, RT=1, split_k=1, U=8, D=0, R=128))
    assert "gemv_upto" not in load("model_gemv_plans").entry_of(single)


# A listing as nvdisasm -c prints one: an outer loop (.L_x_0) around an inner one (.L_x_1), and a forward branch
SASS_LISTING = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E.128 R4, desc[UR4][R2.64] ;
.L_x_1:
        /*0020*/                   LDS.U8 R8, [R9] ;
        /*0030*/                   LDS.U8 R10, [R9+0x80] ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/                   HMMA.16816.F32 R12, R4, R8, R12 ;
        /*0060*/              @P1 BRA `(.L_x_2) ;
        /*0070*/                   BRA `(.L_x_0) ;
.L_x_2:
        /*0080*/                   EXIT ;
"""


def test_sass_loop_reads_the_longest_loop_of_a_listing():
    sass_loop = load("sass_loop")
    loop = sass_loop.longest_loop(SASS_LISTING)
    assert len(loop) == 7 and "LDG.E.128" in loop[0] and "BRA `(.L_x_0)" in loop[-1]
    assert sass_loop.opcode_mix(loop, modifiers=True) == {"LDG.E.128": 1, "LDS.U8": 2, "BRA": 3, "HMMA.16816.F32": 1}
    assert sass_loop.opcode_mix(loop)["LDS"] == 2
    assert sass_loop.longest_loop("        /*0000*/                   EXIT ;") == []


def test_sass_loop_names_the_cuda_kernels_it_reads():
    """--cuda: MLA decode's kernel with a bf16 cache and with an fp8 one (by cvt, and by bit moves in the output's
    product), each source compiled as the package compiles it."""
    variants = load("sass_loop").cuda_variants()
    assert set(variants) == {"mla cuda bf16", "mla cuda fp8", "mla cuda fp8 out_bits"}
    assert all(kernel == "mla_decode" for _, kernel in variants.values())
    assert "#define FP8 0" in variants["mla cuda bf16"][0] and "#define FP8 1" in variants["mla cuda fp8"][0]
    assert "#define OUT_BITS 1" in variants["mla cuda fp8 out_bits"][0]
    assert "#define OUT_BITS 0" in variants["mla cuda fp8"][0]


def test_sass_loop_lists_every_gemv_launch_of_a_plan_table():
    """A plan with a tier up to 8 tokens runs its default at 16-token tiles only; one without, at 8 and 16; a
    q4_K weight's planes are q4_1's; a gate|up shape gets the act*mul epilogue."""
    from cobatch.kernels import quant_pack
    sass_loop = load("sass_loop")
    cfg = {"W": 4, "RT": 1, "split_k": 2, "U": 8, "D": 0, "R": 128}
    table = {"formats": {
        "q4_k": {"shapes": {"28672x4096": {"gemv": cfg, "gemv_upto": {"8": {**cfg, "U": 4}}}}},
        "q8_0": {"shapes": {"4096x4096": {"gemv": {**cfg, "R": 0}}, "1024x4096": {"narrow": {}}}}}}
    launches = sass_loop.plan_gemv_launches(table)
    assert [label for label, _, _ in launches] == ["q4_k 28672x4096 upto 8 bt=8", "q4_k 28672x4096 gemv bt=16",
                                                    "q8_0 4096x4096 gemv bt=16", "q8_0 4096x4096 gemv bt=8"]
    (_, tier, budget), (_, gate_up, _), (_, q8, no_budget), _ = launches
    assert tier["FMT"] == quant_pack.Q4_1 and tier["U"] == 4 and tier["PDL"] and budget == 128
    assert gate_up["ACT"] == 1 and gate_up["BT"] == 16 and not gate_up["PDL"] and not gate_up["ROUTED"]
    assert q8["FMT"] == quant_pack.Q8_0 and q8["ACT"] == 0 and no_budget is None


def test_sass_loop_lists_the_gemv_calls_of_a_model_shape_with_their_tails(monkeypatch):
    """--model-shape: each matrix of the shape on the plan it gets at load. Qwen2.5-7B has none of its own: its q4_K
    qkv (56 chunks, 14 steps a warp) runs 8 ahead with a tail of 6, its down (296 chunks, 8 warps of 37) 16 ahead with
    a tail of 5; gate|up gets the act*mul epilogue."""
    from cobatch.kernels import matmul_plans
    monkeypatch.setattr(matmul_plans, "interpreting", lambda: False)   # the interpreter has its own small plan
    monkeypatch.setattr(matmul_plans, "GEMV_TAILS", True)
    monkeypatch.setattr(matmul_plans, "DEEP_GEMV_WIDE_LONG_K", True)
    launches = {label: c for label, c, _ in load("sass_loop").model_gemv_launches("qwen2.5-7b", ["q4_k"])}
    assert len(launches) == 12 and all(label.endswith(("bt=8", "bt=16")) for label in launches)
    qkv = launches["q4_k qwen2.5-7b qkv 4608x3584 gemv bt=8"]
    down = launches["q4_k qwen2.5-7b down 3584x18944 gemv bt=16"]
    assert (qkv["W"], qkv["U"], qkv["TAIL"], qkv["PDL"]) == (4, 8, 6, True)
    assert (down["W"], down["U"], down["TAIL"], down["BT"], down["PDL"]) == (8, 16, 5, 16, False)
    assert launches["q4_k qwen2.5-7b gate_up 37888x3584 gemv bt=16"]["ACT"] == 1 and qkv["ACT"] == 0


def test_sass_loop_counts_k_steps_as_the_padded_planes_hold_them():
    """K = 1408 (V2-Lite's routed down) is padded to 1536 in its planes: 24 K steps of 64, 6 a warp at W = 4, so U = 2
    leaves no tail (22 steps would not even split among 4 warps)."""
    cfg = {"W": 4, "RT": 4, "split_k": 1, "U": 2, "D": 0, "R": 0}
    table = {"formats": {"q5_0": {"shapes": {"2048x1408": {"gemv": cfg}}}}}
    launches = load("sass_loop").plan_gemv_launches(table)
    assert [c["TAIL"] for _, c, _ in launches] == [0, 0] and all(c["ROUTED"] for _, c, _ in launches)


def test_sass_loop_compiles_the_plans_a_format_borrows_where_it_has_none_of_its_own():
    """NVFP4 runs q4_K's plan of a shape unless it has a GEMV plan of its own there: with `borrowed` that call is
    listed in NVFP4's decode, and the shape NVFP4 plans itself is not listed twice."""
    from cobatch.kernels import quant_pack
    sass_loop = load("sass_loop")
    cfg = {"W": 4, "RT": 1, "split_k": 1, "U": 16, "D": 0, "R": 128}
    table = {"formats": {
        "q4_k": {"shapes": {"6144x4096": {"gemv": cfg}, "4096x4096": {"gemv": cfg}}},
        "nvfp4": {"shapes": {"4096x4096": {"gemv": {**cfg, "U": 4}}}}}}
    own = [label for label, _, _ in sass_loop.plan_gemv_launches(table)]
    assert not any("(as" in label for label in own)
    borrowed = {label: c for label, c, _ in sass_loop.plan_gemv_launches(table, borrowed=True)}
    lent = [label for label in borrowed if label.startswith("nvfp4 (as q4_k)")]
    assert sorted(lent) == ["nvfp4 (as q4_k) 6144x4096 gemv bt=16", "nvfp4 (as q4_k) 6144x4096 gemv bt=8"]
    assert all(borrowed[label]["FMT"] == quant_pack.fragment_layout(quant_pack.NVFP4) for label in lent)
    assert borrowed["nvfp4 4096x4096 gemv bt=8"]["U"] == 4


def test_step_phases_names_each_kernel_by_its_matmul_call():
    """bench/step_phases.py: main matmul kernels take the recorded calls in order, x staging the call after it,
    attention and norms their own phases; idle time is the span no kernel covers, overlaps counted once."""
    sp = load("step_phases")

    def k(name, ts, dur):
        return dict(name=name, ts=ts, dur=dur)
    kernels = [k("_rms_norm_kernel", 0, 2), k("_x_image_kernel", 3, 1), k("quant_gemm", 4, 10),
               k("_decode_split_kernel", 16, 5), k("_decode_reduce_kernel", 20, 2),    # overlaps the split
               k("_gemv_kernel", 25, 8), k("_gemm_ring_kernel", 33, 20), k("_chunk_max_kernel", 60, 1)]
    calls = [("qkv", 1000), ("o", 800), ("gate_up", 4000)]
    assert sp.label_kernels(kernels, calls)
    assert [x["phase"] for x in kernels] == ["norm", "qkv", "qkv", "attention", "attention", "o", "gate_up",
                                             "other"]
    assert [x["bytes"] for x in kernels] == [0, 0, 1000, 0, 0, 800, 4000, 0]
    # span 61 us; nothing runs in 2-3, 14-16, 22-25 and 53-60
    assert sp.idle_us(kernels) == (61.0, 13.0)
    sp.charge(kernels)
    # the reduce (20-22) overlaps the split (16-21): charged 1 us; the rest run alone
    assert [x["charged"] for x in kernels] == [2, 1, 10, 5, 1, 8, 20, 1]
    assert sum(x["charged"] for x in kernels) == 61.0 - 13.0
    rows = {r["phase"]: r for r in sp.phases([kernels], copy_bps=1e9)}
    assert rows["qkv"]["calls"] == 1 and rows["qkv"]["us"] == 11.0
    assert rows["gate_up"]["gbps"] == 4000 / 20 / 1e3 and rows["gate_up"]["of_copy"] == 0.2
    assert rows["attention"]["us"] == 6.0 and rows["attention"]["summed_us"] == 7.0
    assert rows["attention"]["gbps"] is None
    # a call count that does not match leaves the matmuls unnamed
    assert not sp.label_kernels(kernels, calls[:2])
    assert {x["phase"] for x in kernels if x["bytes"] == 0 and "gemv" in x["name"]} == {"matmul"}
