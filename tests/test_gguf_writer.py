"""gguf_writer: random models of real shapes reload through cobatch's loader with the right config and
sane weights; layer cuts of a real model keep everything but the dropped blocks byte-exact."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import gguf
import gguf.quants
import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as T

from cobatch.testing import gguf_writer
from cobatch.config import ModelConfig
from cobatch.errors import UserError
from cobatch.testing.gguf_writer import SHAPES, QUANTS, ModelShape, cut_layers, planned_size, write_random_model
from cobatch.loader.gguf import GGUFFile
from cobatch.model_files import ModelNotFound, smollm2_path
from cobatch.quant.formats import dequantize

SRC = Path(__file__).resolve().parents[1] / "src"


@pytest.fixture(scope="module")
def smollm2() -> GGUFFile:
    try:
        return GGUFFile(smollm2_path())
    except ModelNotFound as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def small_tokenizer(smollm2: GGUFFile, tmp_path_factory) -> Path:
    """SmolLM2's tokenizer cut to its first 1024 tokens: a real tokenizer source that parses in
    milliseconds (gguf-py takes seconds on a 49k vocab), for the tests that are about weights."""
    fields = gguf_writer.tokenizer_metadata(smollm2.path, None)
    path = tmp_path_factory.mktemp("tok") / "small-tokenizer.gguf"
    writer = gguf.GGUFWriter(path, "llama")
    for key, field in fields.items():
        value = field.value[:1024] if key in ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type",
                                              "tokenizer.ggml.merges") else field.value
        writer.add_key_value(key, value, field.vtype, field.sub_type)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _tokenizer_md(f: GGUFFile) -> dict:
    return {k: v for k, v in f.metadata.items() if k.startswith("tokenizer.")}


def _check_weights(f: GGUFFile, name: str) -> None:
    """Decodes identically with cobatch and gguf-py, finite, with the intended scale."""
    t = f.tensors[name]
    if t.tensor_type == T.F32 and len(t.shape) == 1:
        values = f.float_tensor(name)
        assert torch.isfinite(values).all()
        if name.endswith("norm.weight"):
            assert abs(values.mean().item() - 1.0) < 0.05, name
            assert gguf_writer.NORM_JITTER / 3 < values.std().item() < gguf_writer.NORM_JITTER * 3, name
        else:  # bias
            assert gguf_writer.WEIGHT_STD / 3 < values.std().item() < gguf_writer.WEIGHT_STD * 3, name
        return
    w = f.quant_weight(name)
    ours = dequantize(w.raw, t.tensor_type, w.cols)
    ref_rows = min(w.rows, 256)  # gguf-py's numpy decoder is slow; a 256-row slice cross-checks the layout
    reference = gguf.quants.dequantize(w.raw[:ref_rows].numpy(), t.tensor_type).reshape(ref_rows, w.cols)
    np.testing.assert_array_equal(ours[:ref_rows].numpy(), reference, err_msg=name)
    assert torch.isfinite(ours).all(), name
    std = ours.std().item()
    assert gguf_writer.WEIGHT_STD / 3 < std < gguf_writer.WEIGHT_STD * 3, (name, std)
    assert abs(ours.mean().item()) < 0.1 * std, name


@pytest.mark.parametrize("quant", ["q8_0", "q4_k", "q4_1", "q6_k", "f16"])
def test_tiny_model_reloads_with_right_config_and_sane_weights(quant, small_tokenizer, tmp_path):
    path = write_random_model(tmp_path / f"tiny-{quant}.gguf", "tiny", quant, tokenizer_from=small_tokenizer, seed=1)
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    assert (cfg.arch, cfg.n_layers, cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.ffn_dim) == (
        "llama", 2, 256, 4, 2, 64, 512)
    assert (cfg.vocab_size, cfg.context_length, cfg.rope_theta, cfg.rope_dim) == (1024, 4096, 10000.0, 64)
    assert not cfg.qkv_bias and not cfg.rope_neox
    assert f.metadata["general.file_type"] == int(QUANTS[quant].file_type)

    expected = {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(2) for part in
        ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")}
    assert set(f.tensors) == expected
    base = QUANTS[quant].base
    head = base if base in (T.Q8_0, T.F16) else T.Q6_K  # llama.cpp's output-head rule
    for name in expected - {"output.weight"}:
        assert f.tensor_type(name) == (T.F32 if "norm" in name else base), name
    assert f.tensor_type("output.weight") == head
    # GGUF shape convention: [K in, N out]
    assert [int(x) for x in f.tensors["blk.0.attn_k.weight"].shape] == [256, 128]
    assert [int(x) for x in f.tensors["blk.0.ffn_down.weight"].shape] == [512, 256]
    assert [int(x) for x in f.tensors["token_embd.weight"].shape] == [256, 1024]
    for name in f.tensors:
        _check_weights(f, name)


def test_real_tokenizer_is_copied_exactly_and_size_is_planned(smollm2, tmp_path):
    path = write_random_model(tmp_path / "tiny.gguf", "tiny", "q8_0")  # default tokenizer: SmolLM2
    f = GGUFFile(path)
    assert _tokenizer_md(f) == _tokenizer_md(smollm2)
    assert "tokenizer.chat_template" in _tokenizer_md(f)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    assert cfg.vocab_size == 49152 == f.metadata["llama.vocab_size"]
    assert path.stat().st_size == planned_size("tiny", "q8_0")
    assert not path.with_name(path.name + ".partial").exists()


def test_seed_makes_files_reproducible(small_tokenizer, tmp_path):
    def write(name: str, seed: int) -> bytes:
        path = write_random_model(tmp_path / name, "tiny", "q4_k", tokenizer_from=small_tokenizer, seed=seed)
        return path.read_bytes()
    first, again, other = write("a.gguf", 0), write("b.gguf", 0), write("c.gguf", 1)
    assert first == again
    assert first != other and len(first) == len(other)


def test_qwen2_layout_with_bias_tied_embeddings_and_padded_vocab(small_tokenizer, tmp_path, monkeypatch):
    # qwen2.5-0.5b's layout at test size; the vocab is larger than the tokenizer, so it gets padded
    monkeypatch.setitem(SHAPES, "tiny-qwen", ModelShape("qwen2", 2, 256, 4, 2, 512, 1100, 1e6, 1e-6, 32768,
                                                        qkv_bias=True, tied_embeddings=True))
    path = write_random_model(tmp_path / "q.gguf", "tiny-qwen", "q4_k", tokenizer_from=small_tokenizer, n_layers=1,
                              context_length=2048)
    f = GGUFFile(path)
    cfg = ModelConfig.from_metadata(f.metadata, set(f.tensors))
    assert (cfg.arch, cfg.n_layers, cfg.vocab_size, cfg.context_length, cfg.rope_theta) == ("qwen2", 1, 1100, 2048, 1e6)
    assert cfg.qkv_bias and cfg.rope_neox
    assert "output.weight" not in f.tensors
    assert f.tensor_type("token_embd.weight") == T.Q6_K  # tied: the embedding is the output head
    assert [int(x) for x in f.tensors["blk.0.attn_k.bias"].shape] == [128]
    for name in f.tensors:
        _check_weights(f, name)

    tokens, types = f.metadata["tokenizer.ggml.tokens"], f.metadata["tokenizer.ggml.token_type"]
    source = GGUFFile(small_tokenizer).metadata
    assert tokens[:1024] == source["tokenizer.ggml.tokens"] and types[:1024] == source["tokenizer.ggml.token_type"]
    assert tokens[1024:] == [f"<|pad_{i}|>" for i in range(1024, 1100)]
    assert types[1024:] == [int(gguf.TokenType.CONTROL)] * 76


def test_tokenizer_larger_than_the_shapes_vocab_is_an_error(small_tokenizer, tmp_path, monkeypatch):
    monkeypatch.setitem(SHAPES, "too-small", ModelShape("llama", 1, 256, 4, 2, 512, 1000, 1e4, 1e-5, 4096))
    with pytest.raises(UserError, match="1024 tokens, more than the shape's vocab of 1000"):
        write_random_model(tmp_path / "x.gguf", "too-small", tokenizer_from=small_tokenizer)
    assert not list(tmp_path.iterdir())


def test_real_shapes_follow_llama_cpp_quant_mixes():
    def types(shape: str, quant: str) -> dict[str, T]:
        s = SHAPES[shape]
        return {t.name: t.ggml_type for t in gguf_writer.tensor_plan(s, QUANTS[quant], s.vocab_size, s.n_layers)}

    llama = types("llama3-8b", "q4_k_m")
    assert llama["token_embd.weight"] == T.Q4_K and llama["output.weight"] == T.Q6_K
    assert sum(llama[f"blk.{i}.attn_v.weight"] == T.Q6_K for i in range(32)) == 16
    assert sum(llama[f"blk.{i}.ffn_down.weight"] == T.Q6_K for i in range(32)) == 16
    assert llama["blk.0.attn_q.weight"] == T.Q4_K and llama["blk.4.attn_v.weight"] == T.Q4_K
    # d_model 896 is not a whole number of 256-value blocks: llama.cpp's fallbacks, as in real Qwen2.5-0.5B files
    qwen = types("qwen2.5-0.5b", "q4_k")
    assert "output.weight" not in qwen and qwen["token_embd.weight"] == T.Q8_0
    assert qwen["blk.0.attn_q.weight"] == T.Q5_0 and qwen["blk.0.ffn_down.weight"] == T.Q4_K  # K = 4864 fits
    assert qwen["blk.0.attn_q.bias"] == T.F32
    assert all(t == T.Q8_0 or t == T.F32 for t in types("qwen2.5-7b", "q8_0").values())


def test_cut_layers_keeps_everything_but_later_blocks(smollm2, tmp_path):
    path = cut_layers(smollm2.path, tmp_path / "cut.gguf", 2)
    cut = GGUFFile(path)
    kept = [n for n in smollm2.tensors if not n.startswith("blk.") or int(n.split(".")[1]) < 2]
    assert cut.metadata["llama.block_count"] == 2 and cut.metadata["GGUF.tensor_count"] == len(kept)
    changed = {"llama.block_count", "GGUF.tensor_count"}  # GGUF.*: gguf-py's view of the file header
    assert {k: v for k, v in cut.metadata.items() if k not in changed} == {
        k: v for k, v in smollm2.metadata.items() if k not in changed}
    assert list(cut.tensors) == kept
    assert len(kept) == 2 + 2 * 9  # token_embd, output_norm, nine per block
    for name in kept:
        a, b = smollm2.tensors[name], cut.tensors[name]
        assert a.tensor_type == b.tensor_type and list(a.shape) == list(b.shape)
        assert np.asarray(a.data).tobytes() == np.asarray(b.data).tobytes(), name
    assert ModelConfig.from_metadata(cut.metadata, set(cut.tensors)).n_layers == 2


def test_cut_of_a_random_model_is_the_random_model_with_fewer_layers(small_tokenizer, tmp_path):
    # tensors are seeded by name, so cutting layers off equals writing fewer: the cut moved nothing else
    full = write_random_model(tmp_path / "full.gguf", "tiny", "q4_1", tokenizer_from=small_tokenizer)
    short = write_random_model(tmp_path / "short.gguf", "tiny", "q4_1", tokenizer_from=small_tokenizer, n_layers=1)
    assert cut_layers(full, tmp_path / "cut.gguf", 1).read_bytes() == short.read_bytes()
    for n in (0, 3):
        with pytest.raises(UserError, match="between 1 and 2"):
            cut_layers(full, tmp_path / "bad.gguf", n)
    with pytest.raises(UserError, match="destination .* is the input file"):
        cut_layers(full, full, 1)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.gguf", "full.gguf", "short.gguf"]


@pytest.fixture(scope="module")
def smollm2_by_gguf_py(smollm2):
    """gguf-py's own reading of SmolLM2: the oracle for cobatch's directory reader (it takes seconds: read once)."""
    return gguf.GGUFReader(smollm2.path, "r")


def _gguf_py_metadata(reader) -> dict:
    values = {}
    for key, field in reader.fields.items():
        try:
            values[key] = field.contents()
        except Exception:
            pass
    return values


def test_raw_directory_reader_agrees_with_gguf_py(smollm2, smollm2_by_gguf_py):
    want = _gguf_py_metadata(smollm2_by_gguf_py)
    with gguf_writer.RawGGUF(smollm2.path) as raw:
        for name, field in raw.fields.items():
            value = raw.value(field).value
            if isinstance(value, bytes):
                value = value.decode()
            elif isinstance(value, list) and value and isinstance(value[0], bytes):
                value = [item.decode() for item in value]
            assert value == want[name], name
        assert [(t.name, t.ggml_type, list(t.dims), raw.data_start + t.offset, t.nbytes) for t in raw.tensors] == [
            (t.name, t.tensor_type, [int(d) for d in t.shape], int(t.data_offset), int(t.n_bytes))
            for t in smollm2_by_gguf_py.tensors]


def test_unreadable_files_are_user_errors(tmp_path):
    (tmp_path / "empty.gguf").write_bytes(b"")
    (tmp_path / "short.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + bytes(8) + (5).to_bytes(8, "little"))
    for name, message in [("missing.gguf", "not found"), ("empty.gguf", "bad magic"), ("short.gguf", "corrupt")]:
        with pytest.raises(UserError, match=message):
            gguf_writer.RawGGUF(tmp_path / name)


def test_cli_rejects_unknown_shape_with_one_line_and_exit_2(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "cobatch.testing.gguf_writer", "random", "--shape", "llama9-1t",
         "-o", str(tmp_path / "x.gguf")],
        capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(SRC)}, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert "llama9-1t" in lines[0] and all(name in lines[0] for name in SHAPES)
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("argv, message", [
    (["random", "--shape", "tiny", "--quant", "q9_9", "-o", "x.gguf"], "q4_k_m"),  # lists the valid quants
    (["random", "--shape", "tiny", "--layers", "0", "-o", "x.gguf"], "at least 1"),
    (["random", "--shape", "tiny"], "-o/--output"),
    (["cut", "missing.gguf", "out.gguf", "--layers", "2"], "not found"),
    (["random", "--shape", "tiny", "-o", "."], "is a directory"),          # refused before a byte is written
    (["random", "--shape", "tiny", "-o", "no/x.gguf"], "no such directory"),
    (["cut", str(smollm2_path()), ".", "--layers", "2"], "is a directory"),
    (["explode"], "invalid choice"),
])
def test_cli_bad_arguments_exit_2_with_one_line(argv, message, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert gguf_writer.main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and message in err, err
    assert err.startswith("cobatch: error: "), err     # as every other cobatch command says it
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize("which", ["smollm2", "random moe"])
def test_loader_reads_what_gguf_py_reads(which, smollm2_by_gguf_py, small_tokenizer, tmp_path):
    """GGUFFile's own directory reader gives the metadata, tensor formats, shapes and bytes gguf-py's reader gives
    (on the real SmolLM2 file, and on a random MoE file with a K-quant mix and 3-D expert tensors)."""
    if which == "smollm2":
        path, theirs = smollm2_path(), smollm2_by_gguf_py
    else:
        path = write_random_model(tmp_path / "moe.gguf", "qwen3moe-tiny", "q4_k_m", tokenizer_from=small_tokenizer,
                                  seed=3)
        theirs = gguf.GGUFReader(path, "r")
    ours = GGUFFile(path)
    want = _gguf_py_metadata(theirs)
    assert len(want) > 20 and ours.metadata == want
    assert list(ours.tensors) == [t.name for t in theirs.tensors]
    for t in theirs.tensors:
        mine = ours.tensors[t.name]
        assert (mine.tensor_type, mine.shape, mine.n_elements, mine.n_bytes) == \
            (t.tensor_type, tuple(int(d) for d in t.shape), int(t.n_elements), int(t.n_bytes)), t.name
    for t in theirs.tensors[:: max(1, len(theirs.tensors) // 12)]:     # a dozen tensors' bytes, spread out
        assert np.array_equal(ours.tensors[t.name].data, np.asarray(t.data).reshape(-1).view(np.uint8)), t.name
