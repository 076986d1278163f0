"""llama.cpp's samplers as request fields (engine/sampler.py, engine/dry.py): typical-p, top-n-sigma, XTC, DRY,
mirostat, the penalties' window and dynamic temperature, with llama.cpp's names. The OpenAI routes' requests and
llama.cpp's /completion inherit them from here, so both validate them alike; unset (None), a field takes the
server's default, else SamplingParams' own."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, Field


class LlamaCppSamplers(BaseModel):
    typical_p: float | None = Field(None, gt=0, le=1, description="1: off")
    top_n_sigma: float | None = Field(None, le=1e6, description="<= 0: off")
    xtc_probability: float | None = Field(None, ge=0, le=1, description="0: off")
    xtc_threshold: float | None = Field(None, ge=0, le=1, description="above 0.5: off")
    dry_multiplier: float | None = Field(None, ge=0, description="0: off")
    dry_base: float | None = Field(None, ge=1, le=10)
    dry_allowed_length: int | None = Field(None, ge=1)
    dry_penalty_last_n: int | None = Field(None, ge=-1, description="-1: the whole context, 0: off")
    dry_sequence_breakers: list[str] | None = None
    mirostat: int | None = Field(None, ge=0, le=2, description="0: off; 1 or 2: mirostat in place of top-k ... XTC")
    mirostat_tau: float | None = Field(None, ge=0, le=100)
    mirostat_eta: float | None = Field(None, ge=0, le=1)
    repeat_last_n: int | None = Field(None, ge=-1, description="penalties over the last n tokens of prompt and "
                                      "output; -1: repetition over all, presence and frequency the output; 0: off")
    dynatemp_range: float | None = Field(None, ge=0, le=1000, description="0: off")
    dynatemp_exponent: float | None = Field(None, ge=0, le=1000)

    def sampler_fields(self) -> dict[str, Any]:
        """These fields as SamplingParams takes them (None: unset)."""
        fields = {name: getattr(self, name) for name in LlamaCppSamplers.model_fields}
        breakers = fields["dry_sequence_breakers"]
        fields["dry_sequence_breakers"] = None if breakers is None else tuple(breakers)
        return fields
