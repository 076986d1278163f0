"""What a model reads its weights through, whatever the file: a GGUF (loader/gguf.py) or a Hugging Face
checkpoint folder (loader/hf.py). Tensors go by their GGUF names."""

from __future__ import annotations

from typing import Mapping, Protocol

import torch

from cobatch.quant.weight import QuantWeight


class WeightSource(Protocol):
    tensors: Mapping[str, object]       # the names present (`name in source.tensors`)

    def quant_weight(self, name: str) -> QuantWeight:
        """A 2-D weight, [out features, in features], in the format it runs in."""

    def float_tensor(self, name: str) -> torch.Tensor:
        """A small tensor (norm weight, bias, rope factors) as float32."""
