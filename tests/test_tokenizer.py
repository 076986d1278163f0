"""Tokenizer built from GGUF metadata, checked against independent references:
transformers' own GGUF tokenizer loader (real models), sentencepiece (a model trained here), and
small vocabularies whose tokenization is worked out by hand."""

from __future__ import annotations

import functools
import io
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import pre_tokenizers

from cobatch import model_files
from cobatch.loader.gguf import GGUFFile
from cobatch.tokenizer import PRE_TOKENIZERS, Tokenizer, TokenizerError

# --- real models, loaded once per test session (test_chat_template.py imports these) --------------

REAL_MODELS = {"smollm2": model_files.smollm2_path, "qwen_coder": model_files.qwen_coder_path}


@dataclass(frozen=True)
class RealModel:
    name: str
    path: Path
    metadata: dict[str, Any]
    tokenizer: Tokenizer


@functools.cache
def load_real_model(name: str) -> RealModel:
    try:
        path = REAL_MODELS[name]()
    except model_files.ModelNotFound as exc:
        pytest.skip(str(exc))
    metadata = GGUFFile(path).metadata                  # exactly as the loader builds it
    return RealModel(name, path, metadata, Tokenizer.from_metadata(metadata))


@functools.cache
def load_reference_tokenizer(name: str) -> Any:
    """transformers' tokenizer for the same GGUF file: an independent reading of the metadata."""
    from transformers import AutoTokenizer

    path = load_real_model(name).path
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="module", params=sorted(REAL_MODELS))
def real(request: pytest.FixtureRequest) -> RealModel:
    return load_real_model(request.param)


@pytest.fixture(scope="module")
def reference(real: RealModel) -> Any:
    return load_reference_tokenizer(real.name)


TEXTS = [
    "Hello world",
    " Hello  world ",
    "Hello, world! How's it going? I'M FINE, they'LL see. don't won't it's I've we'd",
    "naïve café résumé Ångström façade Zürich straße ÆØÅ",
    "e\u0301 combining accent vs é precomposed",
    "你好，世界！这是一个测试。",
    "日本語のテキストとカタカナ ー",
    "한국어 텍스트입니다",
    "Привет, мир! Україна",
    "مرحبا بالعالم",
    "नमस्ते दुनिया",
    "Emoji: 😀👍🏽🇺🇸 ❤️ 👨‍👩‍👧‍👦 🤖",
    "1 12 123 1234 12345 123456789012345678901234567890",
    "3.14159 1,000,000 -42 +7e-10 0x1F 2024-01-31",
    "a 1 b 22 c",
    "spaces     \t  tabs\t\tnewlines\n\n\r\n end  ",
    "\n",
    "   ",
    "",
    "def foo(x):\n    return x ** 2  # square\n\nclass A:\n\tpass\n",
    'if (a<=b && c!=d) { printf("%d\\n", a); } // <html>&amp;</html>',
    "SELECT * FROM t WHERE id IN (1,2,3);\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi there<|im_end|>\n",
    "text<|endoftext|>more text",
    "ＡＢＣ　full-width ｱｲｳ",
    "zero\u200bwidth\u00a0nbsp",
]

# SmolLM2's tokenizer splits every digit off *before* the GPT-2 regex runs (its tokenizer.json
# pre-tokenizer is Sequence[Digits(individual_digits=True), ByteLevel], llama.cpp's "smollm" does
# the same). transformers' GGUF loader has no "smollm" entry and runs GPT-2's regex alone, which
# differs when whitespace runs up to a numeric character. Those texts are checked against
# transformers' BPE with SmolLM2's published pre-tokenizer instead.
SMOLLM_DIGIT_SPLIT_TEXTS = [
    "a   1",
    "x  42",
    "\t\t1",
    "line1\n2lines\n\n 3",
    "ℕ ² ½ ① Ⅻ ٣ ๓",
    "total:   1,234.56",
]

QWEN_TEXTS = ["<tool_call>\n{\"name\": \"get_weather\"}\n</tool_call>", "<|fim_prefix|>a<|fim_suffix|>b<|fim_middle|>"]


def _smollm_published_pre_tokenizer(reference: Any) -> HFTokenizer:
    backend = HFTokenizer.from_str(reference.backend_tokenizer.to_str())
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
        ]
    )
    return backend


def test_ids_match_transformers(real: RealModel, reference: Any) -> None:
    texts = TEXTS + (QWEN_TEXTS if real.name == "qwen_coder" else [])
    if real.name == "qwen_coder":
        texts = texts + SMOLLM_DIGIT_SPLIT_TEXTS  # nothing special about them for Qwen
    for text in texts:
        assert real.tokenizer.encode(text, add_special=False) == reference.encode(
            text, add_special_tokens=False
        ), text


def test_smollm_digits_split_like_its_published_tokenizer(reference: Any, real: RealModel) -> None:
    if real.name != "smollm2":
        pytest.skip("SmolLM2-specific pre-tokenizer")
    published = _smollm_published_pre_tokenizer(reference)
    for text in TEXTS + SMOLLM_DIGIT_SPLIT_TEXTS:
        expected = published.encode(text, add_special_tokens=False).ids
        assert real.tokenizer.encode(text, add_special=False) == expected, text
    # By hand: the two spaces stay together and each digit stands alone.
    ids = real.tokenizer.encode("x  42", add_special=False)
    assert [real.tokenizer.token_text(i) for i in ids] == ["x", "ĠĠ", "4", "2"]


def test_add_special_follows_metadata(real: RealModel, reference: Any) -> None:
    # Neither model asks for BOS (tokenizer.ggml.add_bos_token = False).
    assert real.metadata["tokenizer.ggml.add_bos_token"] is False
    assert real.tokenizer.add_bos is False and real.tokenizer.add_eos is False
    assert real.tokenizer.encode("Hello world") == reference.encode("Hello world")


def test_decode_roundtrips_and_matches_transformers(real: RealModel, reference: Any) -> None:
    for text in TEXTS + SMOLLM_DIGIT_SPLIT_TEXTS:
        ids = real.tokenizer.encode(text, add_special=False)
        assert real.tokenizer.decode(ids) == text
        assert real.tokenizer.decode(ids) == reference.decode(ids, clean_up_tokenization_spaces=False)
        assert real.tokenizer.decode(ids, skip_special=True) == reference.decode(
            ids, skip_special_tokens=True, clean_up_tokenization_spaces=False
        )


def test_special_markers_are_single_ids(real: RealModel) -> None:
    tokens = real.metadata["tokenizer.ggml.tokens"]
    im_start, im_end = tokens.index("<|im_start|>"), tokens.index("<|im_end|>")
    ids = real.tokenizer.encode("<|im_start|>user\nHi<|im_end|>", add_special=False)
    assert ids[0] == im_start and ids[-1] == im_end
    assert ids[1:-1] == real.tokenizer.encode("user\nHi", add_special=False)
    assert real.tokenizer.is_special(im_start) and real.tokenizer.is_special(im_end)
    assert not real.tokenizer.is_special(ids[1])
    assert real.tokenizer.decode(ids, skip_special=True) == "user\nHi"
    assert real.tokenizer.token_text(im_end) == "<|im_end|>"


def test_qwen_tool_call_marker_is_one_non_special_token() -> None:
    real = load_real_model("qwen_coder")
    tool_call = real.metadata["tokenizer.ggml.tokens"].index("<tool_call>")
    assert real.metadata["tokenizer.ggml.token_type"][tool_call] == 4  # USER_DEFINED
    ids = real.tokenizer.encode("<tool_call>\n{}", add_special=False)
    assert ids[0] == tool_call
    # Kept by skip_special: the tool-call parser needs to see it in the streamed text.
    assert not real.tokenizer.is_special(tool_call)
    assert real.tokenizer.decode(ids, skip_special=True) == "<tool_call>\n{}"


def test_fill_in_the_middle_tokens() -> None:
    real = load_real_model("qwen_coder")
    tokens = real.metadata["tokenizer.ggml.tokens"]
    assert real.tokenizer.fim_ids == tuple(tokens.index(t) for t in ("<|fim_prefix|>", "<|fim_suffix|>",
                                                                        "<|fim_middle|>"))
    assert load_real_model("smollm2").tokenizer.fim_ids is None
    from cobatch.tokenizer import _fim_ids
    vocab = ["<s>", "<PRE>", "<MID>", "<SUF>", "x"]
    assert _fim_ids({}, vocab) == (1, 3, 2)                                   # CodeLlama's texts
    named = {"tokenizer.ggml.fim_pre_token_id": 4, "tokenizer.ggml.fim_suf_token_id": 0,
             "tokenizer.ggml.fim_mid_token_id": 2}
    assert _fim_ids(named, vocab) == (4, 0, 2)                                # the metadata wins


def test_special_ids_from_metadata(real: RealModel, reference: Any) -> None:
    tokens = real.metadata["tokenizer.ggml.tokens"]
    tok = real.tokenizer
    assert tok.vocab_size == len(tokens) == len(reference)
    assert tok.bos_id == real.metadata["tokenizer.ggml.bos_token_id"]
    assert tok.eos_id == real.metadata["tokenizer.ggml.eos_token_id"] == reference.eos_token_id
    # eos plus every end-of-turn marker present: <|im_end|> and <|endoftext|> in both vocabularies.
    assert tok.stop_ids == {tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")}
    assert tok.eos_id in tok.stop_ids


def test_out_of_range_id_is_an_error(real: RealModel) -> None:
    with pytest.raises(TokenizerError, match="outside the vocabulary"):
        real.tokenizer.decode([real.tokenizer.vocab_size])
    with pytest.raises(TokenizerError):
        real.tokenizer.token_text(-1)


# --- streaming --------------------------------------------------------------------------------------

STREAM_TEXT = "Weather: ☀️ 28°C in 東京 🇯🇵, 👨‍👩‍👧 ok — naïve 😀😀"


def _pushes(tokenizer: Tokenizer, ids: list[int], skip_special: bool = True) -> list[str]:
    decoder = tokenizer.stream_decoder(skip_special=skip_special)
    return [decoder.push(i) for i in ids] + [decoder.flush()]


def test_stream_decoder_never_emits_partial_characters(real: RealModel) -> None:
    tok = real.tokenizer
    ids = tok.encode(STREAM_TEXT, add_special=False)
    partial = [i for i in ids if _is_incomplete_utf8(tok.token_bytes(i))]
    assert partial, "text should contain characters split over several tokens"
    chunks = _pushes(tok, ids)
    assert "".join(chunks) == tok.decode(ids) == STREAM_TEXT
    assert not any("\ufffd" in chunk for chunk in chunks)
    assert "" in chunks[:-1]  # something was held back
    emitted = ""
    for chunk in chunks:  # every intermediate state is a clean prefix of the text
        emitted += chunk
        assert STREAM_TEXT.startswith(emitted)


def test_stream_decoder_skips_specials_like_decode(real: RealModel) -> None:
    tok = real.tokenizer
    text = "<|im_start|>assistant\n東京 😀<|im_end|>"
    ids = tok.encode(text, add_special=False)
    assert "".join(_pushes(tok, ids, skip_special=True)) == tok.decode(ids, skip_special=True)
    assert "".join(_pushes(tok, ids, skip_special=False)) == tok.decode(ids) == text


def test_stream_decoder_flush_replaces_an_unfinished_character(real: RealModel) -> None:
    tok = real.tokenizer
    # The first of these characters that the vocabulary spells in several byte tokens.
    split = [ids for ids in (tok.encode(ch, add_special=False) for ch in "😀🦩𓀀𝔘") if len(ids) > 1]
    assert split
    ids = split[0]
    decoder = tok.stream_decoder()
    assert decoder.push(ids[0]) == ""
    assert decoder.flush() == "\ufffd" == tok.decode(ids[:1])


def _is_incomplete_utf8(data: bytes) -> bool:
    try:
        data.decode("utf-8")
        return False
    except UnicodeDecodeError:
        return True


# --- pre-tokenizer choice, on a hand-made byte-level vocabulary ----------------------------------------

# GPT-2's byte alphabet: 188 printable Latin-1 characters stand for themselves, the other 68 bytes
# are spelled U+0100..U+0143.
_BYTE_CHARS = sorted(
    {chr(c) for c in range(ord("!"), ord("~") + 1)}
    | {chr(c) for c in range(0xA1, 0xAD)}
    | {chr(c) for c in range(0xAE, 0x100)}
    | {chr(0x100 + i) for i in range(68)}
)


def _byte_level_metadata(pre: str | None, extra_tokens: list[str], merges: list[str]) -> dict[str, Any]:
    tokens = ["<|endoftext|>"] + _BYTE_CHARS + extra_tokens
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": [3] + [1] * (len(tokens) - 1),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return metadata


def _pieces(tok: Tokenizer, text: str) -> list[str]:
    return [tok.token_text(i) for i in tok.encode(text, add_special=False)]


# "1234" with merges that could build it whole: how the digits end up depends only on the regexes.
_DIGIT_MERGES = (["12", "123", "1234"], ["1 2", "12 3", "123 4"])


@pytest.mark.parametrize(
    ("pre", "expected"),
    [
        ("gpt2", ["1234"]),  # \p{N}+
        ("llama-bpe", ["123", "4"]),  # \p{N}{1,3}
        ("llama3", ["123", "4"]),
        ("qwen2", ["1", "2", "3", "4"]),  # \p{N}
        ("smollm", ["1", "2", "3", "4"]),  # digits split off first
        ("deepseek-llm", ["1234"]),  # \p{N}+
        ("default", ["123", "4"]),  # llama.cpp's fallback ends with [0-9]{3}
    ],
)
def test_pre_tokenizer_digit_grouping(pre: str, expected: list[str]) -> None:
    tok = Tokenizer.from_metadata(_byte_level_metadata(pre, *_DIGIT_MERGES))
    assert _pieces(tok, "1234") == expected


def test_llama3_takes_whole_vocab_words_without_merges() -> None:
    # "hello" is a token but no merges lead to it: llama3 vocabularies (ignore_merges) use it
    # directly, GPT-2 ones cannot reach it.
    llama3 = Tokenizer.from_metadata(_byte_level_metadata("llama-bpe", ["hello", "he"], ["h e"]))
    gpt2 = Tokenizer.from_metadata(_byte_level_metadata("gpt2", ["hello", "he"], ["h e"]))
    assert _pieces(llama3, "hello") == ["hello"]
    assert _pieces(gpt2, "hello") == ["he", "l", "l", "o"]
    assert llama3.add_bos and not gpt2.add_bos  # llama.cpp's defaults when the key is absent


def test_missing_pre_means_default() -> None:
    tok = Tokenizer.from_metadata(_byte_level_metadata(None, *_DIGIT_MERGES))
    assert _pieces(tok, "1234") == ["123", "4"]


@pytest.mark.parametrize("pre", sorted(PRE_TOKENIZERS))
def test_every_supported_pre_tokenizer_builds_and_roundtrips(pre: str) -> None:
    tok = Tokenizer.from_metadata(_byte_level_metadata(pre, [], []))
    text = "Hi there's 12345 ÆØ 東京 😀\n\n  x\t<|endoftext|>"
    ids = tok.encode(text, add_special=False)
    assert ids[-1] == 0 and ids.count(0) == 1
    assert tok.decode(ids) == text


def test_unknown_pre_tokenizer_is_named() -> None:
    with pytest.raises(TokenizerError, match="'mystery-bpe'"):
        Tokenizer.from_metadata(_byte_level_metadata("mystery-bpe", [], []))


def test_unsupported_model_and_missing_pieces() -> None:
    with pytest.raises(TokenizerError, match="'bert'"):
        Tokenizer.from_metadata({"tokenizer.ggml.model": "bert", "tokenizer.ggml.tokens": ["a"]})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model"):
        Tokenizer.from_metadata({"tokenizer.ggml.tokens": ["a"]})
    metadata = _byte_level_metadata("gpt2", [], [])
    del metadata["tokenizer.ggml.merges"]
    with pytest.raises(TokenizerError, match="merges"):
        Tokenizer.from_metadata(metadata)
    metadata = _byte_level_metadata("gpt2", ["ab"], ["a b"])
    metadata["tokenizer.ggml.add_bos_token"] = True
    del metadata["tokenizer.ggml.bos_token_id"]
    with pytest.raises(TokenizerError, match="bos"):
        Tokenizer.from_metadata(metadata)


# --- sentencepiece-style vocabularies ("llama") --------------------------------------------------------


def _spm_metadata(pieces: list[tuple[str, float]], **overrides: Any) -> dict[str, Any]:
    """<unk>, <s>, </s>, the 256 byte tokens, then `pieces` (text, score)."""
    specials = [("<unk>", 0.0, 2), ("<s>", 0.0, 3), ("</s>", 0.0, 3)]
    byte_tokens = [(f"<0x{b:02X}>", 0.0, 6) for b in range(256)]
    rows = specials + byte_tokens + [(text, score, 1) for text, score in pieces]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [r[0] for r in rows],
        "tokenizer.ggml.scores": [r[1] for r in rows],
        "tokenizer.ggml.token_type": [r[2] for r in rows],
    }
    metadata.update(overrides)
    return metadata


# Higher score merges first. "ab" is listed before "bc" but scores lower, so "abc" must become a|bc.
_HAND_PIECES = [
    ("▁", -100.0), ("h", -100.0), ("e", -100.0), ("l", -100.0), ("o", -100.0),
    ("a", -100.0), ("b", -100.0), ("c", -100.0),
    ("▁h", -1.0), ("ll", -2.0), ("▁he", -3.0), ("llo", -4.0), ("▁hello", -5.0),
    ("ab", -10.0), ("bc", -6.0),
]


def _spm_pieces(tok: Tokenizer, ids: list[int]) -> list[str]:
    return [tok.token_text(i) for i in ids]


def test_sentencepiece_merges_by_score_by_hand() -> None:
    tok = Tokenizer.from_metadata(_spm_metadata(_HAND_PIECES))
    assert tok.add_bos and not tok.add_eos and tok.bos_id == 1 and tok.eos_id == 2  # llama.cpp defaults
    assert _spm_pieces(tok, tok.encode("hello", add_special=False)) == ["▁hello"]
    assert _spm_pieces(tok, tok.encode("hell", add_special=False)) == ["▁he", "ll"]
    assert _spm_pieces(tok, tok.encode("abc", add_special=False)) == ["▁", "a", "bc"]
    assert _spm_pieces(tok, tok.encode("hello hello", add_special=False)) == ["▁hello", "▁hello"]
    # é is not in the vocabulary: its two UTF-8 bytes as byte tokens.
    assert _spm_pieces(tok, tok.encode("hé", add_special=False)) == ["▁h", "<0xC3>", "<0xA9>"]
    # BOS from add_bos; a special token in the text is one id and text after it gets a prefix space.
    assert _spm_pieces(tok, tok.encode("hello</s>hello")) == ["<s>", "▁hello", "</s>", "▁hello"]
    ids = tok.encode("hé hello")
    assert tok.decode(ids, skip_special=True) == "hé hello"
    assert tok.decode(ids) == "<s> hé hello"
    assert "".join(_pushes(tok, ids)) == "hé hello"


def test_sentencepiece_without_space_prefix() -> None:
    tok = Tokenizer.from_metadata(
        _spm_metadata(_HAND_PIECES, **{"tokenizer.ggml.add_space_prefix": False, "tokenizer.ggml.add_bos_token": False})
    )
    assert _spm_pieces(tok, tok.encode("hello")) == ["h", "e", "llo"]
    assert _spm_pieces(tok, tok.encode(" hello")) == ["▁hello"]
    assert tok.decode(tok.encode(" hello")) == " hello"


def test_sentencepiece_matches_a_trained_sentencepiece_model() -> None:
    sentencepiece = pytest.importorskip("sentencepiece")
    rng = random.Random(1234)
    words = (
        "the quick brown fox jumps over lazy dog tokenizer token hello world naïve café über straße "
        "lower lowest newer wider sentence piece merge score byte fallback unicode encoding decoding "
        "stream model vocabulary prefix space 東京 大阪 пример слово"
    ).split()
    corpus = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 12))) for _ in range(3000)]
    model = io.BytesIO()
    sentencepiece.SentencePieceTrainer.train(
        sentence_iterator=iter(corpus),
        model_writer=model,
        model_type="bpe",
        vocab_size=500,
        hard_vocab_limit=False,
        byte_fallback=True,
        character_coverage=1.0,
        normalization_rule_name="identity",  # GGUF carries no normalizer
        remove_extra_whitespaces=False,
        add_dummy_prefix=True,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        num_threads=1,
        minloglevel=2,
    )
    sp = sentencepiece.SentencePieceProcessor(model_proto=model.getvalue())

    def token_type(i: int) -> int:  # as llama.cpp's converter writes them
        if sp.is_unknown(i):
            return 2
        if sp.is_control(i):
            return 3
        if sp.is_byte(i):
            return 6
        return 1

    n = sp.get_piece_size()
    assert n > 400  # enough merges to make the comparison meaningful
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": [sp.id_to_piece(i) for i in range(n)],
        "tokenizer.ggml.scores": [sp.get_score(i) for i in range(n)],
        "tokenizer.ggml.token_type": [token_type(i) for i in range(n)],
        "tokenizer.ggml.bos_token_id": sp.bos_id(),
        "tokenizer.ggml.eos_token_id": sp.eos_id(),
        "tokenizer.ggml.unknown_token_id": sp.unk_id(),
    }
    tok = Tokenizer.from_metadata(metadata)
    texts = corpus[:300] + [
        "the quick brown fox",
        "hello  world",
        " leading space",
        "trailing space ",
        "thequickbrownfox",
        "unseen ZEBRA 你好 😀 ü",
        "a\tb\nc",
        "東京は大阪",
    ]
    for text in texts:
        ids = tok.encode(text, add_special=False)
        assert ids == sp.encode(text), text
        assert tok.decode(ids) == sp.decode(ids) == text
    assert tok.encode("hello") == [sp.bos_id()] + sp.encode("hello")
