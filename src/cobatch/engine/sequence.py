"""A session's own state: its tokens, how many of them are in the KV cache, its blocks, its sampling state.

Everything shared between sessions (the KV pool, scratch, CUDA graphs) belongs to the engine.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from cobatch.engine.drafts import DraftRecord, Prediction, TokenIndex
from cobatch.engine.grammar import TokenMatcher
from cobatch.engine.sampler import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"      # admitted to the engine, no KV yet (or preempted)
    RUNNING = "running"      # holds KV blocks; prefilling or decoding
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    request_id: str
    prompt_len: int
    params: SamplingParams
    seed: int
    token_ids: list[int]                     # prompt followed by every sampled token
    block_table: list[int] = field(default_factory=list)
    block_hashes: list[int] = field(default_factory=list)   # chain hashes of this sequence's full blocks
    adapter: int = 0                         # the model's LoRA adapter slot its rows run through (0: none)
    hash_root: int | None = None             # where its blocks' chain hashes start (kv_cache.prefix_root)
    num_computed: int = 0                    # tokens whose K/V are in the cache
    num_cached_prompt: int = 0               # prompt tokens served from the prefix cache
    num_prompt_logprobs: int = 0             # prompt tokens after the first whose logprob was reported
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: str | None = None         # "stop" | "length" | "abort" | "grammar_error"
    arrival: float = field(default_factory=time.monotonic)
    arrival_order: int = 0                   # its place among the scheduler's arrivals (the priority policy's tie)
    first_token_time: float | None = None
    matcher: TokenMatcher | None = None      # where the output stands in its grammar (params.grammar)
    draft: list[int] = field(default_factory=list)   # this step's speculative tokens (engine/speculative.py)
    lookup: TokenIndex = field(default_factory=TokenIndex)   # its tokens for prompt lookup (filled when drafting)
    drafts: DraftRecord = field(default_factory=DraftRecord)   # how its recent drafts fared
    prediction: Prediction | None = None     # params.prediction as a draft source
    draft_from_prediction: bool = False      # this step's drafts came from it
    prediction_accepted: int = 0             # its drafts kept so far (OpenAI's accepted_prediction_tokens) ...
    prediction_rejected: int = 0             # ... and not kept (rejected_prediction_tokens)
    mirostat_mu: float | None = None         # mirostat's state (params.mirostat), from its last sampled token

    @property
    def output_ids(self) -> list[int]:
        return self.token_ids[self.prompt_len:]

    @property
    def num_output(self) -> int:
        return len(self.token_ids) - self.prompt_len

    @property
    def pending(self) -> int:
        """Tokens that still need a forward pass (1 while decoding, more while prefilling)."""
        return len(self.token_ids) - self.num_computed

    @property
    def is_decoding(self) -> bool:
        return self.status is SeqStatus.RUNNING and self.pending == 1 and self.num_output > 0
