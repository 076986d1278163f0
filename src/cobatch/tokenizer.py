"""Text <-> token ids, built from a GGUF file's `tokenizer.ggml.*` metadata.

A GGUF carries no tokenizer.json, only llama.cpp's description of the vocabulary. We rebuild an
equivalent HF `tokenizers` pipeline from it (the BPE itself is the library's) and follow llama.cpp's
conventions wherever the metadata leaves a choice open: which split regexes a `tokenizer.ggml.pre`
name stands for, the add_bos/add_eos defaults, which tokens end a turn.

Decoding is done here rather than by `tokenizers`: every token maps to the exact bytes it stands for,
so `decode` and the streaming decoder agree byte for byte and a UTF-8 character split over several
byte tokens is only ever emitted whole.
"""

from __future__ import annotations

import codecs
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tokenizers import AddedToken, Regex, models, normalizers, pre_tokenizers
from tokenizers import Tokenizer as _HFTokenizer


class TokenizerError(ValueError):
    """The metadata describes a tokenizer we cannot build, or a token id is out of range."""


# tokenizer.ggml.token_type values (llama.cpp's llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6

# Token texts llama.cpp treats as "end of generation" whatever their declared type.
END_OF_TURN_TEXTS = frozenset(
    {
        "<|eot_id|>",
        "<|eom_id|>",
        "<|im_end|>",
        "<|end|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "<|end_of_text|>",
        "<EOT>",
        "<end_of_utterance>",
    }
)

# Fill-in-the-middle token texts (prefix, suffix, middle) llama.cpp recognizes when the metadata names none:
# Qwen2.5-Coder / StarCoder 2, StarCoder, DeepSeek-style, CodeLlama.
FIM_TEXTS = (
    ("<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    ("<fim-prefix>", "<fim-suffix>", "<fim-middle>"),
    ("<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    ("<PRE>", "<SUF>", "<MID>"),
)

# Repository-context token texts (repository name, file separator): Qwen2.5-Coder, StarCoder 2.
FIM_REPO_TEXTS = (("<|repo_name|>", "<|file_sep|>"), ("<repo_name>", "<file_sep>"))

SPM_SPACE = "\u2581"  # sentencepiece writes a space as "▁"


# --- pre-tokenizer regexes, per tokenizer.ggml.pre ------------------------------------------------
# Each entry is a chain: every regex splits the pieces left by the one before, matches and the gaps
# between them both becoming pieces (llama.cpp's unicode_regex_split == HF Split "isolated").

_GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
_LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Qwen2 is llama3 with single digits.
_QWEN2 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_TEKKEN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
    r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
_GPT4O = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?"
    r"|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# DeepSeek's CJK ranges (as its tokenizer.json spells them, including the odd U+0800..U+4E00 span).
_DEEPSEEK_CJK = "[\u4e00-\u9fa5\u0800-\u4e00\uac00-\ud7ff]+"
# DeepSeek-LLM's letter class: Latin, Greek, Cyrillic, Armenian, Georgian, Cherokee, Glagolitic,
# Coptic, full-width Latin and a few more cased scripts.
_DEEPSEEK_LETTERS = (
    "\\s?[A-Za-z\u00b5\u00c0-\u00d6\u00d8-\u00f6\u00f8-\u01ba\u01bc-\u01bf\u01c4-\u0293\u0295-\u02af"
    "\u0370-\u0373\u0376\u0377\u037b-\u037d\u037f\u0386\u0388-\u038a\u038c\u038e-\u03a1\u03a3-\u03f5"
    "\u03f7-\u0481\u048a-\u052f\u0531-\u0556\u10a0-\u10c5\u13a0-\u13f5\u13f8-\u13fd\u1c90-\u1cba"
    "\u1cbd-\u1cbf\u1d00-\u1d2b\u1d6b-\u1d77\u1d79-\u1d9a\u1e00-\u1f15\u1f18-\u1f1d\u1f20-\u1f45"
    "\u1f48-\u1f4d\u1f50-\u1f57\u1f59\u1f5b\u1f5d\u1f5f-\u1f7d\u1f80-\u1fb4\u1fb6-\u1fbc\u1fbe"
    "\u1fc2-\u1fc4\u1fc6-\u1fcc\u1fd0-\u1fd3\u1fd6-\u1fdb\u1fe0-\u1fec\u1ff2-\u1ff4\u1ff6-\u1ffc"
    "\u2102\u2107\u210a-\u2113\u2115\u2119-\u211d\u2124\u2126\u2128\u212a-\u212d\u212f-\u2134\u2139"
    "\u213c-\u213f\u2145-\u2149\u214e\u2183\u2184\u2c00-\u2c7b\u2c7e-\u2ce4\u2ceb-\u2cee\u2cf2\u2cf3"
    "\ua640-\ua66d\ua680-\ua69b\ua722-\ua76f\ua771-\ua787\ua78b-\ua78e\uab70-\uabbf\ufb00-\ufb06"
    "\ufb13-\ufb17\uff21-\uff3a\uff41-\uff5a\U00010400-\U0001044f\U000104b0-\U000104d3"
    "\U000104d8-\U000104fb\U00010c80-\U00010cb2\U00010cc0-\U00010cf2\U000118a0-\U000118df"
    "\U0001e900-\U0001e943]+"
)


@dataclass(frozen=True)
class _PreTokenizer:
    regexes: tuple[str, ...]
    ignore_merges: bool = False  # a piece that is a whole vocab token is taken as is (llama3 family)
    add_bos: bool = False  # llama.cpp's default when tokenizer.ggml.add_bos_token is absent


_LLAMA3_PRE = _PreTokenizer((_LLAMA3,), ignore_merges=True, add_bos=True)
_GPT2_PRE = _PreTokenizer((_GPT2,))
# StarCoder-style vocabularies (SmolLM included) put every digit in its own piece before the GPT-2
# regex runs; SmolLM2's own tokenizer.json is Sequence[Digits(individual), ByteLevel].
_DIGITS_THEN_GPT2 = _PreTokenizer((r"\p{N}", _GPT2))
_QWEN2_PRE = _PreTokenizer((_QWEN2,))

PRE_TOKENIZERS: dict[str, _PreTokenizer] = {
    "default": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|]+", _GPT2, r"\p{N}+", r"[0-9][0-9][0-9]")),
    "llama3": _LLAMA3_PRE,
    "llama-v3": _LLAMA3_PRE,
    "llama-bpe": _LLAMA3_PRE,
    "falcon3": _LLAMA3_PRE,
    "pixtral": _LLAMA3_PRE,
    "dbrx": _PreTokenizer((_LLAMA3,)),
    "smaug-bpe": _PreTokenizer((_LLAMA3,)),
    "gpt2": _GPT2_PRE,
    "gpt-2": _GPT2_PRE,
    "phi-2": _GPT2_PRE,
    "mpt": _GPT2_PRE,
    "olmo": _GPT2_PRE,
    "smollm": _DIGITS_THEN_GPT2,
    "starcoder": _DIGITS_THEN_GPT2,
    "refact": _DIGITS_THEN_GPT2,
    "codeshell": _DIGITS_THEN_GPT2,
    "qwen2": _QWEN2_PRE,
    "deepseek-r1-qwen": _QWEN2_PRE,
    "stablelm2": _QWEN2_PRE,
    "deepseek-llm": _PreTokenizer(
        (
            r"[\r\n]",
            _DEEPSEEK_LETTERS,
            "\\s?[!-/:-~\uff01-\uff0f\uff1a-\uff5e\u2018-\u201f\u3000-\u3002]+",
            r"\s+$",
            _DEEPSEEK_CJK,
            r"\p{N}+",
        )
    ),
    "deepseek-coder": _PreTokenizer((r"[\r\n]", r"\s?\p{L}+", r"\s?\p{P}+", _DEEPSEEK_CJK, r"\p{N}")),
    "falcon": _PreTokenizer((r"[\p{P}\$\+<=>\^~\|`]+", _GPT2, r"[0-9][0-9][0-9]")),
    "tekken": _PreTokenizer((_TEKKEN,), ignore_merges=True, add_bos=True),
    "gpt-4o": _PreTokenizer((_GPT4O,)),
    "llama4": _PreTokenizer((_GPT4O,)),
}


def _byte_alphabet() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used to spell byte-level vocabularies."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    table = {b: chr(b) for b in printable}
    shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + shifted)
            shifted += 1
    return table


_BYTE_OF_CHAR = {ch: b for b, ch in _byte_alphabet().items()}


def _as_list(value: Any) -> list:
    return list(value) if value is not None else []


def _optional_id(metadata: Mapping[str, Any], key: str, vocab_size: int) -> int | None:
    value = metadata.get(key)
    if value is None:
        return None
    value = int(value)
    return value if 0 <= value < vocab_size else None


def _special_ids(metadata: Mapping[str, Any], tokens: list[str], parts: tuple[str, ...],
                 known_texts: tuple[tuple[str, ...], ...]) -> tuple[int, ...] | None:
    """Token ids named by tokenizer.ggml.fim_{part}_token_id for every part, else found by one of the known
    texts (all parts of one spelling), else None."""
    n = len(tokens)
    named = tuple(_optional_id(metadata, f"tokenizer.ggml.fim_{part}_token_id", n) for part in parts)
    if all(i is not None for i in named):
        return named
    index = {text: i for i, text in enumerate(tokens)}
    for texts in known_texts:
        if all(t in index for t in texts):
            return tuple(index[t] for t in texts)
    return None


def _fim_ids(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[int, int, int] | None:
    """The fill-in-the-middle tokens: from tokenizer.ggml.fim_{pre,suf,mid}_token_id, else by their texts."""
    return _special_ids(metadata, tokens, ("pre", "suf", "mid"), FIM_TEXTS)


def _fim_repo_ids(metadata: Mapping[str, Any], tokens: list[str]) -> tuple[int, int] | None:
    """The repository-context tokens of code models (repository name, file separator), as llama.cpp's /infill
    uses them for extra files: tokenizer.ggml.fim_{rep,sep}_token_id, else by their texts."""
    return _special_ids(metadata, tokens, ("rep", "sep"), FIM_REPO_TEXTS)


class Tokenizer:
    """Encode/decode for one GGUF vocabulary (byte-level BPE or sentencepiece-style)."""

    def __init__(
        self,
        backend: _HFTokenizer,
        tokens: list[str],
        token_types: list[int],
        token_bytes: list[bytes],
        *,
        bos_id: int | None,
        eos_id: int | None,
        stop_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        strip_leading_space: bool,
        fim_ids: tuple[int, int, int] | None = None,
        fim_repo_ids: tuple[int, int] | None = None,
    ) -> None:
        self._backend = backend
        self._tokens = tokens
        self._token_types = token_types
        self._token_bytes = token_bytes
        self.vocab_size = len(tokens)
        self.bos_id = bos_id
        self.eos_id = eos_id
        self.stop_ids = stop_ids
        self.add_bos = add_bos
        self.add_eos = add_eos
        # Sentencepiece vocabularies prepend a space when encoding; decoding takes it back off.
        self._strip_leading_space = strip_leading_space
        self.fim_ids = fim_ids      # (prefix, suffix, middle) for fill-in-the-middle, if the vocabulary has them
        self.fim_repo_ids = fim_repo_ids    # (repository name, file separator), if it has them

    # --- construction -----------------------------------------------------------------------------

    @classmethod
    def from_metadata(cls, metadata: Mapping[str, Any]) -> Tokenizer:
        model = metadata.get("tokenizer.ggml.model")
        if model is None:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.model; the file carries no tokenizer")
        tokens = [str(t) for t in _as_list(metadata.get("tokenizer.ggml.tokens"))]
        if not tokens:
            raise TokenizerError("GGUF metadata has no tokenizer.ggml.tokens")
        token_types = [int(t) for t in _as_list(metadata.get("tokenizer.ggml.token_type"))]
        if not token_types:
            token_types = [NORMAL] * len(tokens)
        if len(token_types) != len(tokens):
            raise TokenizerError(
                f"tokenizer.ggml.token_type has {len(token_types)} entries for {len(tokens)} tokens"
            )
        # llama.cpp marks end-of-turn-looking tokens as control even when the converter did not.
        token_types = [
            CONTROL if text in END_OF_TURN_TEXTS and kind in (NORMAL, USER_DEFINED) else kind
            for text, kind in zip(tokens, token_types)
        ]

        if model == "gpt2":
            pre_name = metadata.get("tokenizer.ggml.pre") or "default"
            pre = PRE_TOKENIZERS.get(pre_name)
            if pre is None:
                raise TokenizerError(
                    f"unsupported tokenizer.ggml.pre {pre_name!r} for a byte-level BPE vocabulary; "
                    f"supported: {', '.join(sorted(PRE_TOKENIZERS))}"
                )
            if metadata.get("tokenizer.ggml.merges") is None:
                raise TokenizerError("byte-level BPE vocabulary without tokenizer.ggml.merges")
            merges = _as_list(metadata["tokenizer.ggml.merges"])
            backend = _byte_level_backend(tokens, merges, pre)
            token_bytes = [_byte_level_bytes(text, kind) for text, kind in zip(tokens, token_types)]
            default_bos, default_eos = pre.add_bos, False
            default_bos_id = default_eos_id = None
            strip_leading_space = False
        elif model == "llama":
            add_space_prefix = bool(metadata.get("tokenizer.ggml.add_space_prefix", True))
            scores = [float(s) for s in _as_list(metadata.get("tokenizer.ggml.scores"))]
            scores += [0.0] * (len(tokens) - len(scores))
            unk_id = _optional_id(metadata, "tokenizer.ggml.unknown_token_id", len(tokens))
            if unk_id is None and UNKNOWN in token_types:
                unk_id = token_types.index(UNKNOWN)
            backend = _sentencepiece_backend(tokens, token_types, scores, unk_id, add_space_prefix)
            token_bytes = [_sentencepiece_bytes(text, kind) for text, kind in zip(tokens, token_types)]
            default_bos, default_eos = True, False
            default_bos_id, default_eos_id = 1, 2  # llama.cpp's defaults for a sentencepiece vocab
            strip_leading_space = add_space_prefix
        else:
            raise TokenizerError(
                f"unsupported tokenizer.ggml.model {model!r}; supported: 'gpt2' (byte-level BPE), "
                "'llama' (sentencepiece)"
            )

        _register_special_tokens(backend, tokens, token_types)

        n = len(tokens)
        bos_id = _optional_id(metadata, "tokenizer.ggml.bos_token_id", n)
        eos_id = _optional_id(metadata, "tokenizer.ggml.eos_token_id", n)
        if bos_id is None and "tokenizer.ggml.bos_token_id" not in metadata and default_bos_id is not None:
            bos_id = default_bos_id if default_bos_id < n else None
        if eos_id is None and "tokenizer.ggml.eos_token_id" not in metadata and default_eos_id is not None:
            eos_id = default_eos_id if default_eos_id < n else None
        add_bos = bool(metadata.get("tokenizer.ggml.add_bos_token", default_bos))
        add_eos = bool(metadata.get("tokenizer.ggml.add_eos_token", default_eos))
        if add_bos and bos_id is None:
            raise TokenizerError("tokenizer.ggml.add_bos_token is set but there is no valid bos_token_id")
        if add_eos and eos_id is None:
            raise TokenizerError("tokenizer.ggml.add_eos_token is set but there is no valid eos_token_id")

        stop_ids = {i for i, text in enumerate(tokens) if text in END_OF_TURN_TEXTS}
        for key in ("tokenizer.ggml.eot_token_id", "tokenizer.ggml.eom_token_id"):
            extra = _optional_id(metadata, key, n)
            if extra is not None:
                stop_ids.add(extra)
        if eos_id is not None:
            stop_ids.add(eos_id)

        return cls(
            backend,
            tokens,
            token_types,
            token_bytes,
            bos_id=bos_id,
            eos_id=eos_id,
            stop_ids=frozenset(stop_ids),
            add_bos=add_bos,
            add_eos=add_eos,
            strip_leading_space=strip_leading_space,
            fim_ids=_fim_ids(metadata, tokens),
            fim_repo_ids=_fim_repo_ids(metadata, tokens),
        )

    # --- encoding ---------------------------------------------------------------------------------

    def encode(self, text: str, add_special: bool = True) -> list[int]:
        """Token ids for `text`. Control/user-defined token texts in it (e.g. "<|im_start|>") become
        their single ids. `add_special` adds BOS/EOS as the model's metadata asks."""
        ids = self._backend.encode(text, add_special_tokens=False).ids
        if add_special:
            if self.add_bos and self.bos_id is not None:
                ids.insert(0, self.bos_id)
            if self.add_eos and self.eos_id is not None:
                ids.append(self.eos_id)
        return ids

    # --- decoding ---------------------------------------------------------------------------------

    def token_text(self, token_id: int) -> str:
        """The token as the vocabulary spells it (e.g. "Ġthe", "▁the", "<|im_end|>")."""
        self._check_id(token_id)
        return self._tokens[token_id]

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes of text this token stands for (may be part of a UTF-8 character)."""
        self._check_id(token_id)
        return self._token_bytes[token_id]

    def is_special(self, token_id: int) -> bool:
        """Control tokens (BOS, EOS, <|im_start|>, ...) and the unknown token: not part of the text."""
        self._check_id(token_id)
        return self._token_types[token_id] in (CONTROL, UNKNOWN)

    def decode(self, ids: Sequence[int], skip_special: bool = False) -> str:
        return b"".join(self._pieces(ids, skip_special)).decode("utf-8", errors="replace")

    def stream_decoder(self, skip_special: bool = True, keep: Collection[int] = ()) -> StreamDecoder:
        """keep: special tokens whose text is given even when skip_special (tool-call markers that are control
        tokens, such as Mistral's [TOOL_CALLS])."""
        return StreamDecoder(self, skip_special, frozenset(keep))

    def special_ids(self, texts: Iterable[str]) -> frozenset[int]:
        """The ids of those of `texts` that are one special token of this vocabulary."""
        ids = (self._backend.encode(text, add_special_tokens=False).ids for text in texts)
        return frozenset(i[0] for i in ids if len(i) == 1 and self.is_special(i[0]))

    def _pieces(self, ids: Iterable[int], skip_special: bool) -> Iterable[bytes]:
        first = True
        for token_id in ids:
            piece = self._piece(token_id, skip_special)
            if piece is None:
                continue
            if first and self._strip_leading_space and piece.startswith(b" "):
                piece = piece[1:]
            first = False
            yield piece

    def _piece(self, token_id: int, skip_special: bool) -> bytes | None:
        """Bytes for one token, or None when it is skipped."""
        self._check_id(token_id)
        if skip_special and self._token_types[token_id] in (CONTROL, UNKNOWN):
            return None
        return self._token_bytes[token_id]

    def _check_id(self, token_id: int) -> None:
        if not 0 <= token_id < self.vocab_size:
            raise TokenizerError(f"token id {token_id} is outside the vocabulary (size {self.vocab_size})")


class StreamDecoder:
    """Turns generated token ids into text as they arrive.

    Bytes of a character split over several tokens are held back until the character is complete,
    so a streamed chunk never ends in a partial character or a spurious U+FFFD.
    """

    def __init__(self, tokenizer: Tokenizer, skip_special: bool = True, keep: frozenset[int] = frozenset()) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special
        self._keep = keep
        self._utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._first = True

    def push(self, token_id: int) -> str:
        piece = self._tokenizer._piece(token_id, self._skip_special and token_id not in self._keep)
        if piece is None:
            return ""
        if self._first and self._tokenizer._strip_leading_space and piece.startswith(b" "):
            piece = piece[1:]
        self._first = False
        return self._utf8.decode(piece)

    def flush(self) -> str:
        """Whatever is still held back (an incomplete character becomes U+FFFD), and reset."""
        text = self._utf8.decode(b"", final=True)
        self._utf8.reset()
        return text


# --- backends ---------------------------------------------------------------------------------------


def _split_merge(merge: str) -> tuple[str, str]:
    # llama.cpp splits at the first space after the first character.
    pos = merge.find(" ", 1)
    if pos < 0:
        raise TokenizerError(f"malformed BPE merge {merge!r}")
    return merge[:pos], merge[pos + 1 :]


def _byte_level_backend(tokens: list[str], merges: list[str], pre: _PreTokenizer) -> _HFTokenizer:
    vocab = {text: i for i, text in reversed(list(enumerate(tokens)))}  # first id wins on duplicates
    try:
        model = models.BPE(
            vocab=vocab,
            merges=[_split_merge(str(m)) for m in merges],
            ignore_merges=pre.ignore_merges,
            fuse_unk=False,
        )
    except Exception as exc:  # tokenizers raises a plain Exception for inconsistent merges
        raise TokenizerError(f"cannot build BPE from tokenizer.ggml.merges: {exc}") from exc
    backend = _HFTokenizer(model)
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Split(Regex(r), behavior="isolated") for r in pre.regexes]
        + [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return backend


def _byte_level_bytes(text: str, kind: int) -> bytes:
    # Control and user-defined tokens are stored as plain text; the rest in the byte alphabet.
    if kind in (CONTROL, USER_DEFINED, UNKNOWN):
        return text.encode("utf-8")
    try:
        return bytes(_BYTE_OF_CHAR[ch] for ch in text)
    except KeyError:
        return text.encode("utf-8")


def _sentencepiece_backend(
    tokens: list[str],
    token_types: list[int],
    scores: list[float],
    unk_id: int | None,
    add_space_prefix: bool,
) -> _HFTokenizer:
    """Sentencepiece BPE as llama.cpp runs it: repeatedly merge the adjacent pair whose concatenation
    is the highest-scoring vocabulary token, falling back to <0xXX> byte tokens for unknown text.
    Expressed as HF BPE merges ranked by the score of the token they produce."""
    mergeable = {}
    for i, (text, kind) in enumerate(zip(tokens, token_types)):
        if kind in (NORMAL, USER_DEFINED) and text not in mergeable:
            mergeable[text] = i
    ranked: list[tuple[float, int, int, tuple[str, str]]] = []
    for text, i in mergeable.items():
        for cut in range(1, len(text)):
            left, right = text[:cut], text[cut:]
            if left in mergeable and right in mergeable:
                ranked.append((-scores[i], i, cut, (left, right)))
    ranked.sort()
    vocab = {text: i for i, text in reversed(list(enumerate(tokens)))}
    byte_fallback = all(f"<0x{b:02X}>" in vocab for b in range(256))
    model = models.BPE(
        vocab=vocab,
        merges=[pair for *_, pair in ranked],
        unk_token=tokens[unk_id] if unk_id is not None else None,
        byte_fallback=byte_fallback,
        fuse_unk=False,
    )
    backend = _HFTokenizer(model)
    # llama.cpp adds the prefix space at the start of every stretch of text that follows a special
    # token (or the start); HF normalizes each such stretch separately, so Prepend does the same.
    steps = [normalizers.Prepend(SPM_SPACE)] if add_space_prefix else []
    backend.normalizer = normalizers.Sequence(steps + [normalizers.Replace(" ", SPM_SPACE)])
    return backend


def _sentencepiece_bytes(text: str, kind: int) -> bytes:
    if kind == BYTE and len(text) == 6 and text.startswith("<0x") and text.endswith(">"):
        return bytes([int(text[3:5], 16)])
    if kind in (CONTROL, UNKNOWN):
        return text.encode("utf-8")
    return text.replace(SPM_SPACE, " ").encode("utf-8")


def _register_special_tokens(backend: _HFTokenizer, tokens: list[str], token_types: list[int]) -> None:
    """Control tokens become special added tokens and user-defined ones plain added tokens, so their
    text in a prompt is matched whole (before any splitting) and maps to the vocabulary id."""
    control = [t for t, kind in zip(tokens, token_types) if kind in (CONTROL, UNKNOWN) and t]
    user_defined = [t for t, kind in zip(tokens, token_types) if kind == USER_DEFINED and t]
    backend.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in control])
    backend.add_tokens([AddedToken(t, special=False, normalized=False) for t in user_defined])
