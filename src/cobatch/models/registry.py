"""Which forward runs a model: the llama family's, or DeepSeek's (multi-head latent attention)."""

from __future__ import annotations

from cobatch.config import ModelConfig
from cobatch.models.deepseek import DeepseekModel
from cobatch.models.llama import LlamaModel

Model = LlamaModel | DeepseekModel


def model_class(cfg: ModelConfig) -> type[LlamaModel] | type[DeepseekModel]:
    return DeepseekModel if cfg.mla is not None else LlamaModel
