"""Speculative decoding with prompt lookup (n-gram drafts; vLLM's "ngram" method, llama.cpp's lookup decoding),
with a draft model (engine/draft_model.py), and with a request's predicted output (OpenAI's Predicted Outputs).

A decoding sequence whose last n tokens occurred earlier in its own text (prompt or output) is given the
tokens that followed that occurrence as drafts. A request that says what its output will mostly be (a file
to rewrite with a few edits) drafts from that prediction instead (Prediction), whether or not the server
speculates otherwise. The step then runs the sequence's last token and its k
drafts as k + 1 rows, samples a token at every row, and keeps the sampled tokens while each draft equals the
token sampled before it: one step can emit up to k + 1 tokens. Decode reads every weight once per step
whatever the rows (the GEMV's token tile holds 8), so accepted drafts are nearly free; rejected ones cost
their rows' attention and activations, and their KV entries, past the sequence's end, are simply overwritten
later.

On CUDA a step of decoders and their drafts replays the decode graph of its row count, each draft a decode
row of its own (engine/runner.py); on the CPU (and eager CUDA steps) a sequence's rows are one causal query.
Row j samples with the sequence's (seed, step + j) noise, the draw plain decoding would make for that token
(engine/sampler.py). In the CUDA graphs, steps of up to 8 rows compute each row bitwise as plain decoding does
(the GEMV and decode attention are batch-invariant there), so the output is plain decoding's exactly;
elsewhere up to float rounding.

Only sequences whose sampling does not depend on the tokens before it in the same step speculate: no
grammar, no penalties, no bad words, no pending min_tokens, no logprobs of the prompt. A sequence whose recent
drafts were mostly rejected pauses drafting (DraftRecord).

The draft sources and their state live in engine/drafts.py; this module holds the rules for running them.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from cobatch.engine.drafts import DraftModelSpec, NgramSpec
from cobatch.engine.sampler import reads_feedback
from cobatch.errors import UserError

if TYPE_CHECKING:
    from cobatch.engine.sequence import Sequence


def parse_speculative_config(raw: str | None) -> NgramSpec | DraftModelSpec | None:
    """The --speculative-config flag (vLLM's JSON) as an NgramSpec, or a DraftModelSpec where it names a model
    (None: off); a bad one is a UserError."""
    if raw is None:
        return None
    try:
        config = json.loads(raw)
        if not isinstance(config, dict):
            raise ValueError("it must be a JSON object")
        if config.get("method", "draft_model" if "model" in config else "ngram") == "draft_model":
            return DraftModelSpec.from_config(config)
        return NgramSpec.from_config(config)
    except ValueError as exc:
        raise UserError(f"--speculative-config: {exc}") from None


def speculative_flags(args) -> NgramSpec | DraftModelSpec | None:
    """Speculative decoding as the command line asks: vLLM's --speculative-config, or llama.cpp's --model-draft
    with --draft-max."""
    config = parse_speculative_config(getattr(args, "speculative_config", None))
    draft = getattr(args, "model_draft", None)
    if draft is None:
        return config
    if config is not None:
        raise UserError("give --speculative-config or --model-draft, not both")
    try:
        return DraftModelSpec(draft, args.draft_max)
    except ValueError as exc:
        raise UserError(f"--draft-max: {exc}") from None


# On CUDA a step's rows cost little up to the narrow GEMV's first 8-token tile; a second tile costs 22-30 %
# more, and past the GEMV's crossover (32-64 rows) every weight is dequantized for cuBLAS. H200, Llama-3-8B
# Q4_K_M, one step: 1 row 2.96 ms, 5 rows 3.25, 8 rows 3.08-3.31, 10-16 rows 4.0-4.3, 40 rows 8.7. With
# drafts all rejected, a cap of 8 rows cost 1-8 % and one of 16 rows 18-28 %; with drafts all kept, 16 rows
# beat 8 only at B = 4-8 (bench/results/speculative-2026-11-30-cuda*.log at 5a66009^). So drafts fill a step up to 8
# rows there; decode attention plans such steps as one row (kernels/attention.py, invariant_rows), so their
# rows are bitwise plain decoding's. On the CPU a row costs its compute wherever it is: no cap.
CUDA_STEP_ROWS = 8


def step_rows_with_drafts(device) -> int | None:
    """The most rows a step with drafts may have on this device (None: only the token budget bounds it)."""
    return CUDA_STEP_ROWS if device.type == "cuda" else None


def can_speculate(seq: "Sequence") -> bool:
    """Does this sequence's sampling of a token depend only on that token's logits and step?"""
    p = seq.params
    return (seq.matcher is None and not reads_feedback(p) and not p.bad_words and seq.num_output >= p.min_tokens
            and p.prompt_logprobs is None and not p.embed)
