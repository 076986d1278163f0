"""A GGUF file's metadata changed at load, as llama.cpp's flags change it: --override-kv KEY=TYPE:VALUE, and the
rope flags (--rope-freq-base, --rope-scaling, --rope-scale / --rope-freq-scale, --yarn-orig-ctx, --yarn-beta-fast,
--yarn-beta-slow, --yarn-attn-factor) as the keys they stand for.

An override is a (key, value) pair; "{arch}" in a key stands for the file's general.architecture. A context scaling
factor stretches the model's context with it, as llama.cpp lets -c grow past the trained context then: the
context length becomes the original one (--yarn-orig-ctx, else the file's) times the factor, unless an
--override-kv sets the context length itself; a factor without a scaling type scales linearly.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

from cobatch.errors import UserError

Override = tuple[str, Any]

_TYPES = ("int", "float", "bool", "str")

# flag dest -> the key it sets (each a number; --rope-scaling a name)
ROPE_FLAGS = {"rope_freq_base": "{arch}.rope.freq_base", "rope_scaling": "{arch}.rope.scaling.type",
              "rope_scale": "{arch}.rope.scaling.factor",
              "yarn_orig_ctx": "{arch}.rope.scaling.original_context_length",
              "yarn_beta_fast": "{arch}.rope.scaling.yarn_beta_fast",
              "yarn_beta_slow": "{arch}.rope.scaling.yarn_beta_slow",
              "yarn_attn_factor": "{arch}.rope.scaling.attn_factor"}


def parse_override(text: str) -> Override:
    """llama.cpp's --override-kv KEY=TYPE:VALUE, TYPE one of int, float, bool (true / false) or str."""
    key, equals, rest = text.partition("=")
    kind, colon, raw = rest.partition(":")
    if not key or not equals or not colon or kind not in _TYPES:
        raise UserError(f"--override-kv {text!r}: KEY=TYPE:VALUE, TYPE one of {', '.join(_TYPES)}")
    try:
        if kind == "int":
            return key, int(raw)
        if kind == "float":
            value = float(raw)
            if not math.isfinite(value):
                raise ValueError
            return key, value
        if kind == "bool":
            if raw not in ("true", "false"):
                raise ValueError
            return key, raw == "true"
        return key, raw
    except ValueError:
        raise UserError(f"--override-kv {text!r}: {raw!r} is not a {kind}") from None


def override_flags(args) -> tuple[Override, ...]:
    """The overrides a command's flags ask for (each parsed, a bad one a UserError naming its flag)."""
    overrides = [parse_override(text) for text in getattr(args, "override_kv", None) or ()]
    freq_scale = getattr(args, "rope_freq_scale", None)
    if freq_scale is not None:
        if not 0 < freq_scale <= 1:
            raise UserError(f"--rope-freq-scale: in (0, 1], the inverse of the context scaling (got {freq_scale})")
        overrides.append((ROPE_FLAGS["rope_scale"], 1.0 / freq_scale))
    for dest, key in ROPE_FLAGS.items():
        value = getattr(args, dest, None)
        if value is None:
            continue
        if dest != "rope_scaling" and not (math.isfinite(value) and value > 0):
            raise UserError(f"--{dest.replace('_', '-')}: a positive number (got {value})")
        overrides.append((key, value))
    return tuple(overrides)


def apply_overrides(metadata: dict[str, Any], overrides: Iterable[Override]) -> None:
    """Set each override in `metadata` (in place), then stretch the context by a scaling factor given."""
    arch = metadata.get("general.architecture", "")
    given = {key.replace("{arch}", arch): value for key, value in overrides}
    metadata.update(given)
    factor_key, length_key = f"{arch}.rope.scaling.factor", f"{arch}.context_length"
    type_key = f"{arch}.rope.scaling.type"
    if factor_key in given and type_key not in given and metadata.get(type_key) in (None, "none"):
        metadata[type_key] = "linear"          # llama.cpp's --rope-scale alone scales the positions linearly
    if factor_key in given and length_key not in given:
        original_key = f"{arch}.rope.scaling.original_context_length"
        original = int(metadata.get(original_key) or metadata.get(length_key) or 4096)
        metadata[original_key] = original
        metadata[length_key] = int(original * float(given[factor_key]))
