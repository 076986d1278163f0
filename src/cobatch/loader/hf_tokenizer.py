"""The Tokenizer of a Hugging Face checkpoint folder: tokenizer.json runs as it is (the `tokenizers` library),
tokenizer_config.json names BOS / EOS and the chat template (or chat_template.jinja holds it), and
generation_config.json's eos_token_id adds stop tokens, as vLLM takes them.

The token table cobatch decodes with (tokenizer.py) is rebuilt from the vocabulary: byte-level vocabularies spell
bytes in GPT-2's alphabet, sentencepiece-style ones write spaces as U+2581 and bytes as <0xXX>. Ids past the
tokenizer's vocabulary up to the model's embedding rows (Qwen pads to 151936) are control tokens <|pad_N|>, as the
GGUF converter writes them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as _HFTokenizer

from cobatch.errors import UserError
from cobatch.tokenizer import (BYTE, CONTROL, END_OF_TURN_TEXTS, NORMAL, USER_DEFINED, Tokenizer, _byte_level_bytes,
                               _fim_ids, _fim_repo_ids, _sentencepiece_bytes)


def _json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path}: {exc}") from None


def _steps(component: dict | None) -> list[dict]:
    """A tokenizer.json component and, for a Sequence, its parts."""
    if not component:
        return []
    parts = component.get("decoders") or component.get("normalizers") or component.get("pretokenizers") or []
    return [component, *parts]


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells a special token as text or as an AddedToken dict."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def chat_template_source(folder: Path) -> str | None:
    """The chat template: chat_template.jinja, else tokenizer_config.json's chat_template (the default one of a
    list of named templates)."""
    if (folder / "chat_template.jinja").is_file():
        return (folder / "chat_template.jinja").read_text()
    template = _json(folder / "tokenizer_config.json").get("chat_template")
    if isinstance(template, list):
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default") or next(iter(named.values()), None)
    return template if isinstance(template, str) and template else None


def tokenizer_from_folder(folder: Path, vocab_size: int) -> Tokenizer:
    path = folder / "tokenizer.json"
    if not path.is_file():
        raise UserError(f"{folder}: no tokenizer.json (cobatch reads the tokenizers library's format; a "
                        "sentencepiece-only tokenizer.model is not enough)")
    try:
        backend = _HFTokenizer.from_file(str(path))
    except Exception as exc:        # tokenizers raises a plain Exception on a bad file
        raise UserError(f"cannot read {path}: {exc}") from None
    spec = _json(path)
    tok_config = _json(folder / "tokenizer_config.json")
    added = {t["id"]: t for t in spec.get("added_tokens", [])}
    vocab = backend.get_vocab(with_added_tokens=True)
    n = max(vocab_size, max(vocab.values(), default=-1) + 1)
    tokens = [f"<|pad_{i}|>" for i in range(n)]
    types = [CONTROL] * n
    for text, i in vocab.items():
        tokens[i] = text
        types[i] = (CONTROL if added[i].get("special") else USER_DEFINED) if i in added else NORMAL
    byte_level = any(step.get("type") == "ByteLevel" for step in _steps(spec.get("decoder")))
    if not byte_level:
        types = [BYTE if kind == NORMAL and len(t) == 6 and t.startswith("<0x") and t.endswith(">") else kind
                 for t, kind in zip(tokens, types)]
    types = [CONTROL if t in END_OF_TURN_TEXTS and kind in (NORMAL, USER_DEFINED) else kind
             for t, kind in zip(tokens, types)]
    spell = _byte_level_bytes if byte_level else _sentencepiece_bytes
    token_bytes = [spell(t, kind) for t, kind in zip(tokens, types)]
    # HF's decoder strips the space a sentencepiece normalizer prepended: the same as llama.cpp's add_space_prefix
    strip_leading_space = any(step.get("type") == "Strip" and step.get("start") for step in
                              _steps(spec.get("decoder")))

    def token_id(key: str) -> int | None:
        text = _token_text(tok_config.get(key))
        return vocab.get(text) if text is not None else None

    bos_id, eos_id = token_id("bos_token"), token_id("eos_token")
    # The post-processor is where tokenizer.json adds BOS / EOS; ask it rather than re-reading its template
    plain, full = backend.encode("a", add_special_tokens=False).ids, backend.encode("a").ids
    add_bos = bool(tok_config.get("add_bos_token", bos_id is not None and full[:1] == [bos_id] != plain[:1]))
    add_eos = bool(tok_config.get("add_eos_token", eos_id is not None and full[-1:] == [eos_id] != plain[-1:]))
    stop_ids = {i for i, t in enumerate(tokens) if t in END_OF_TURN_TEXTS}
    extra = _json(folder / "generation_config.json").get("eos_token_id")
    for i in ([extra] if isinstance(extra, int) else extra or []) + ([eos_id] if eos_id is not None else []):
        if 0 <= int(i) < n:
            stop_ids.add(int(i))
    if add_bos and bos_id is None:
        raise UserError(f"{folder}: the tokenizer adds a BOS token but tokenizer_config.json names none")
    return Tokenizer(backend, tokens, types, token_bytes, bos_id=bos_id, eos_id=eos_id,
                     stop_ids=frozenset(stop_ids), add_bos=add_bos, add_eos=add_eos,
                     strip_leading_space=strip_leading_space, fim_ids=_fim_ids({}, tokens),
                     fim_repo_ids=_fim_repo_ids({}, tokens))
