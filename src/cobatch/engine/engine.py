"""Engine: add requests, abort them, and step() -- one forward pass that advances every session.

Used by the CLI, the server and the benchmarks. Not thread-safe: one thread drives it (the server
runs it in its own thread and talks to it through queues).

Overlapped steps (`overlap=True`, vLLM's "async scheduling"): while decode step n runs on the device, the
host plans and launches step n + 1, whose input tokens are step n's, read on the device; only then does
it wait for step n's tokens and turn them into outputs. The GPU no longer idles while the host plans,
stages inputs and post-processes (H200, a random Llama-3-8B: bench/results/decode-*-overlap-ab.log at 5a66009^).
A step is planned ahead only where nothing but the input token depends on step n's results: every running sequence
decodes, samples without reading its own tokens (no penalties, grammar, bad words or drafts), and nobody
waits for a free slot. The repetition, presence and frequency penalties and mirostat do not stop it: the sampler
counts the last token and takes mirostat's state on the device (sampler.reads_host_feedback; COBATCH_PENALTIES_AHEAD=0
makes their steps wait for the host instead); DRY still does. A sequence that step n
ends (a stop token) has computed one token too many, which is dropped; its blocks are freed only after that step
in device order, so no one else's KV is touched.
step() then returns step n's outputs, so the outputs trail the device by one step, never by tokens.
"""

from __future__ import annotations

import itertools
import os
from collections.abc import Callable
from dataclasses import dataclass

from cobatch.engine.draft_model import DraftModel
from cobatch.engine.drafts import PREDICTION_SPEC, DraftModelSpec, NgramSpec, Prediction, propose
from cobatch.engine.grammar import GrammarError, Grammars
from cobatch.engine.kv_cache import BlockManager, BlockSpill, KVPool, prefix_root, salted_root
from cobatch.engine.runner import LaunchedStep, ModelRunner, PromptLogprob
from cobatch.engine.sampler import SamplingParams, reads_feedback, reads_host_feedback
from cobatch.engine.scheduler import Scheduler, StepPlan
from cobatch.engine.sequence import Sequence, SeqStatus
from cobatch.engine.speculative import can_speculate, step_rows_with_drafts
from cobatch.errors import UserError

# Sequences with repetition / presence / frequency penalties or mirostat planned ahead too (their last token counted,
# mirostat's state taken, on the device), where they made every step of their batch wait for the host (one penalized
# session: q8_0 B = 64 6.67 -> 6.16 ms a step, bench/results/penalties_ahead.md)
PENALTIES_AHEAD = os.environ.get("COBATCH_PENALTIES_AHEAD", "1") == "1"


class ContextLengthExceeded(UserError):
    """The prompt (plus at least one generated token) does not fit the context window."""


@dataclass(slots=True)
class StepOutput:
    request_id: str
    new_token: int | None            # None when the step only aborted/finished it
    finished: bool
    finish_reason: str | None        # "stop" | "length" | "abort" | "grammar_error" (TokenMatcher.failed)
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    prompt_logprobs: list[PromptLogprob] | None = None     # prompt tokens' logprobs reported by this step
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    embedding: list[float] | None = None      # params.embed: the last prompt token's final hidden state
    stop_token: bool = False                  # new_token ended the request as an end of turn / stop_token_ids
    prediction_accepted: int = 0              # params.prediction's drafts kept so far, and not kept
    prediction_rejected: int = 0


class Engine:
    def __init__(self, runner: ModelRunner, stop_ids: frozenset[int], *, max_context: int,
                 max_num_seqs: int = 64, max_step_tokens: int = 2048, prefill_chunk: int = 512,
                 grammars: Grammars | None = None, speculative: NgramSpec | DraftModelSpec | None = None,
                 overlap: bool = True, spill: BlockSpill | None = None, drafter: DraftModel | None = None,
                 scheduling_policy: str = "fcfs"):
        self.runner = runner
        self.overlap = overlap           # plan and launch decode step n + 1 before step n's tokens are read
        self.grammars = grammars         # compiles SamplingParams.grammar; None: grammars are refused
        self.speculative = speculative   # drafts for decoding sequences (engine/speculative.py)
        self.drafter = drafter           # the draft model, where speculative is a DraftModelSpec
        self._proposed: dict[str, list[int]] = {}       # its drafts for this step's plan (request id -> tokens)
        self.pool: KVPool = runner.pool
        # spill: where evicted prefix-cache blocks go and come back from (engine/disk_cache.py); None: nowhere
        self.blocks = BlockManager(self.pool.num_blocks, self.pool.block_size, spill=spill)
        self.scheduler = Scheduler(self.blocks, max_num_seqs, max(max_step_tokens, max_num_seqs), prefill_chunk,
                                   draft=self._draft,      # every request may carry a prediction
                                   prepare_drafts=self._run_drafter if drafter is not None else None,
                                   draft_rows=step_rows_with_drafts(runner.device),
                                   draft_max_running=speculative.disable_by_batch_size if speculative else None,
                                   policy=scheduling_policy)
        self.stop_ids = stop_ids
        self.max_context = min(max_context, self.pool.num_blocks * self.pool.block_size)
        self.seqs: dict[str, Sequence] = {}
        self._ids = itertools.count()
        self._aborted: list[Sequence] = []
        self._in_flight: LaunchedStep | None = None    # a step launched ahead, not collected yet

    # --- requests -------------------------------------------------------------------------------
    def add_request(self, prompt_ids: list[int], params: SamplingParams, request_id: str | None = None) -> str:
        if not prompt_ids:
            raise UserError("prompt is empty")
        if len(prompt_ids) >= self.max_context:
            raise ContextLengthExceeded(
                f"prompt has {len(prompt_ids)} tokens but the context holds {self.max_context} "
                f"(prompt plus at least one generated token)")
        vocab = self.runner.model.vocab_rows
        bad = next((t for t in prompt_ids if not 0 <= t < vocab), None)
        if bad is not None:     # on CUDA an out-of-range gather would kill the context for every session
            raise UserError(f"prompt token id {bad} is outside the vocabulary (size {vocab})")
        params.validate(vocab)
        if params.priority and not self.scheduler.by_priority:
            raise UserError(f"priority {params.priority} needs the priority scheduling policy "
                            "(serve with --scheduling-policy priority)")
        request_id = request_id or f"req-{next(self._ids)}"
        if request_id in self.seqs:
            raise ValueError(f"duplicate request id {request_id}")
        seq = Sequence(request_id, len(prompt_ids), params, params.resolved_seed(), list(prompt_ids))
        if params.adapter is not None:
            self._use_adapter(seq, params.adapter)
        if params.cache_salt is not None:       # its blocks' chains start from the salt (and the adapter's root)
            seq.hash_root = salted_root(seq.hash_root, params.cache_salt)
        if params.prediction:
            seq.prediction = Prediction(params.prediction)
        if params.grammar is not None:
            if self.grammars is None:
                raise GrammarError("this engine has no grammar support (constrained decoding)")
            seq.matcher = self.grammars.matcher(params.grammar)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    @property
    def _lora(self):
        """The model's LoRA adapter slots (models/lora.LoraSet), or None."""
        return getattr(self.runner.model, "lora", None)

    def load_adapter(self, adapter) -> None:
        """Serve a LoRA adapter (loader/lora.Adapter) from the next step on, in a free slot of the model's."""
        lora = self._lora
        if lora is None:
            raise UserError("this model was loaded without LoRA adapter slots (give adapters or allow runtime "
                            "loading at start)")
        lora.load(adapter)

    def unload_adapter(self, name: str) -> None:
        """Stop serving a LoRA adapter; refused while a request runs through it."""
        lora = self._lora
        if lora is None or name not in lora.slots:
            raise UserError(f"no LoRA adapter named {name!r} is loaded")
        users = sum(seq.adapter == lora.slot(name) for seq in self.seqs.values())
        if users:
            raise UserError(f"LoRA adapter {name!r} is in use by {users} request{'s' if users > 1 else ''}")
        lora.unload(name)

    def _use_adapter(self, seq: Sequence, name: str) -> None:
        lora = self._lora
        if lora is None or name not in lora.slots:
            loaded = ", ".join(map(repr, lora.slots)) if lora is not None else "none"
            raise UserError(f"no LoRA adapter named {name!r} is loaded (loaded: {loaded})")
        seq.adapter = lora.slot(name)
        seq.hash_root = prefix_root(lora.adapters[seq.adapter - 1].fingerprint)

    def abort(self, request_id: str) -> None:
        """Free the request's slot and KV now; step() reports it once as finished with 'abort'."""
        seq = self.seqs.get(request_id)
        if seq is None or seq.status is SeqStatus.FINISHED:
            return
        seq.finish_reason = "abort"
        self.scheduler.finished(seq)
        self._aborted.append(seq)

    def has_work(self) -> bool:
        return self.scheduler.has_work() or bool(self._aborted) or self._in_flight is not None

    @property
    def stats(self):
        return self.scheduler.stats

    # --- the step -------------------------------------------------------------------------------
    def step(self, on_launched: Callable[[], None] | None = None) -> list[StepOutput]:
        """One forward pass. `on_launched` is called once the step's device work is queued, just before the host
        waits for it (not for a step that samples nothing): the caller's host work done there overlaps the GPU
        instead of delaying the launch. With overlap, the step returned may be one launched by the previous call,
        and the next one is already running when this returns."""
        outputs = [self._output(seq, None) for seq in self._aborted]
        for seq in self._aborted:
            self.seqs.pop(seq.request_id, None)
        self._aborted.clear()
        launched, self._in_flight = self._in_flight, None
        try:
            if launched is None:
                plan = self.scheduler.plan()
                if not plan.items:
                    return outputs
                launched = self.runner.launch(plan)
            if self.overlap:
                ahead = self._plan_ahead(launched)
                if ahead is not None:
                    self._in_flight = self.runner.launch(ahead)
            if on_launched is not None and launched.out is not None:
                on_launched()
            result = self.runner.collect(launched)
        except BaseException:
            self._in_flight = None           # the caller fails these requests; nothing is left half-done
            raise
        plan = launched.plan
        finished = 0
        prompt_lps = result.prompt_logprobs or [None] * len(plan.items)
        embeddings = result.embeddings or [None] * len(plan.items)
        drafted = result.drafted or [None] * len(plan.items)
        mirostat_mu = result.mirostat_mu or [None] * len(plan.items)
        for (seq, n), token, logprob, top, prompt_lp, embedding, draft_out, mu in zip(
                plan.items, result.tokens, result.logprobs, result.top, prompt_lps, embeddings, drafted, mirostat_mu):
            if seq.status is not SeqStatus.RUNNING:
                continue        # a step planned ahead: ended by the step before it (stop token, abort)
            if seq.draft:
                finished += self._accept_drafts(seq, [(token, logprob, top)] + draft_out, outputs)
                continue
            self._advance_cache(seq, n)
            if prompt_lp:
                seq.num_prompt_logprobs += len(prompt_lp)
            if token is None:
                if prompt_lp:
                    outputs.append(self._output(seq, None, prompt_logprobs=prompt_lp))
                continue
            seq.token_ids.append(token)
            if mu is not None:
                seq.mirostat_mu = mu
            if seq.matcher is not None:
                seq.matcher.accept(token)
            reason = self._stop_reason(seq, token)
            if reason:
                seq.finish_reason = reason
                self.scheduler.finished(seq)
                self.seqs.pop(seq.request_id, None)
                finished += 1
            out = self._output(seq, token, logprob, top, prompt_lp, embedding)
            out.stop_token = reason == "stop" and self._is_stop_token(seq, token)
            outputs.append(out)
        self.scheduler.end_step(finished)
        if finished and self.drafter is not None:
            self.drafter.release_gone(self.seqs)        # the draft cache's blocks of the sequences that ended
        return outputs

    def _plan_ahead(self, launched: LaunchedStep) -> StepPlan | None:
        """The next decode step, planned while `launched` runs, or None where it must wait for the host to see
        launched's tokens (see the module's notes)."""
        scheduler = self.scheduler
        if launched.out is None or (self.speculative is not None
                                    and scheduler.drafts_each(scheduler.running, all_decoding=True)):
            return None                      # prompt-lookup drafts read the tokens
        if scheduler.waiting and len(scheduler.running) < scheduler.max_num_seqs:
            return None                      # admit the newcomer first
        sampling = {id(seq) for seq in launched.sampling_seqs()}
        continuing = []
        for seq in scheduler.running:
            if id(seq) not in sampling or not self._samples_blind(seq):
                return None
            # It samples its last token in `launched` when that token reaches max_tokens or the context.
            if seq.num_output + 1 < seq.params.max_tokens and len(seq.token_ids) + 1 < self.max_context:
                continuing.append(seq)
        return scheduler.plan_ahead(continuing, launched) if continuing else None

    @staticmethod
    def _samples_blind(seq: Sequence) -> bool:
        """Can this sequence's next token be sampled without the host knowing its tokens so far?"""
        params = seq.params
        return (not seq.draft and seq.prediction is None and seq.matcher is None and not params.bad_words
                and not (reads_host_feedback if PENALTIES_AHEAD else reads_feedback)(params) and not params.embed)

    def _advance_cache(self, seq: Sequence, n: int) -> None:
        """Account for n newly computed tokens and make blocks that became full findable."""
        seq.num_computed += n
        bs = self.blocks.block_size
        while len(seq.block_hashes) < seq.num_computed // bs:
            i = len(seq.block_hashes)
            prev = seq.block_hashes[-1] if seq.block_hashes else seq.hash_root
            tokens = tuple(seq.token_ids[i * bs:(i + 1) * bs])
            seq.block_hashes.append(self.blocks.register_full_block(seq.block_table[i], prev, tokens))

    # --- speculative decoding ---------------------------------------------------------------------
    def _draft(self, seq: Sequence, budget: int) -> list[int]:
        """Drafts for a decoding sequence, from its prediction if it has one (while it finds some there), else
        by prompt lookup when the server speculates: none that would pass max_tokens or the context."""
        seq.draft_from_prediction = False
        if not self._may_draft(seq):
            return []
        room = self._room(seq, budget)
        if seq.prediction is not None:
            spec = self.speculative if isinstance(self.speculative, NgramSpec) else PREDICTION_SPEC
            drafts = seq.prediction.propose(seq.token_ids, seq.prompt_len, spec, room)
            if drafts or self.speculative is None:
                seq.draft_from_prediction = bool(drafts)
                return drafts
        if self.drafter is not None:
            return self._proposed.get(seq.request_id, [])[:room]
        return propose(seq.token_ids, seq.lookup, self.speculative, room)

    def _may_draft(self, seq: Sequence) -> bool:
        return ((seq.prediction is not None or self.speculative is not None) and can_speculate(seq)
                and seq.drafts.worth_drafting(seq.num_output))

    def _room(self, seq: Sequence, budget: int) -> int:
        """Drafts that would pass neither max_tokens nor the context, at most budget."""
        return min(budget, seq.params.max_tokens - seq.num_output - 1, self.max_context - len(seq.token_ids) - 1)

    def _run_drafter(self, decoders: list[Sequence], budget: int) -> None:
        """The draft model's proposals for this step's decoders (all at once), before the plan takes them."""
        self.drafter.release_gone(self.seqs)            # (aborted ones too)
        seqs = [seq for seq in decoders if self._may_draft(seq)]
        limits = [min(self._room(seq, budget), self.speculative.num_tokens) for seq in seqs]
        self._proposed = self.drafter.propose(seqs, limits)

    def _accept_drafts(self, seq: Sequence, sampled: list, outputs: list[StepOutput]) -> int:
        """Row j of a speculating sequence ran draft j - 1 (row 0 its last token) and sampled sampled[j]. Keep
        sampled[0], then sampled[j] while draft j - 1 equals sampled[j - 1] (row j's input was the real next
        token), up to a token that ends the request. Returns 1 if the request finished."""
        keep = 1
        while keep < len(sampled) and seq.draft[keep - 1] == sampled[keep - 1][0]:
            keep += 1
        reason, n_kept = None, 0
        while n_kept < keep and not reason:
            token = sampled[n_kept][0]
            seq.token_ids.append(token)
            n_kept += 1
            reason = self._stop_reason(seq, token)
        kept = sampled[:n_kept]
        self.scheduler.stats.accepted_tokens += n_kept - 1
        seq.drafts.add(len(seq.draft), keep - 1)
        if seq.draft_from_prediction:
            seq.prediction_accepted += n_kept - 1
            seq.prediction_rejected += len(seq.draft) - (n_kept - 1)
        # The rows whose input was right hold valid K/V: the last token's and the kept drafts'.
        self._advance_cache(seq, len(kept))
        seq.draft = []
        if reason:
            seq.finish_reason = reason
            self.scheduler.finished(seq)
            self.seqs.pop(seq.request_id, None)
        for i, (token, logprob, top) in enumerate(kept):
            out = self._output(seq, token, logprob, top)
            if i < len(kept) - 1:                   # only the last one may end the request
                out.finished, out.finish_reason = False, None
            else:
                out.stop_token = reason == "stop" and self._is_stop_token(seq, token)
            outputs.append(out)
        return 1 if reason else 0

    def _is_stop_token(self, seq: Sequence, token: int) -> bool:
        return (token in self.stop_ids and not seq.params.ignore_eos) or token in seq.params.stop_token_ids

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if seq.matcher is not None and seq.matcher.failed:    # llguidance gave up (its mask then allows only EOS)
            return "grammar_error"
        if self._is_stop_token(seq, token):
            return "stop"
        if seq.matcher is not None and seq.matcher.done:      # the grammar is complete
            return "stop"
        if seq.num_output >= p.max_tokens or len(seq.token_ids) >= self.max_context:
            return "length"
        return None

    @staticmethod
    def _output(seq: Sequence, token: int | None, logprob=None, top=None, prompt_logprobs=None,
                embedding=None) -> StepOutput:
        return StepOutput(seq.request_id, token, seq.status is SeqStatus.FINISHED, seq.finish_reason,
                          logprob, top, prompt_logprobs or None, seq.prompt_len, seq.num_cached_prompt, embedding,
                          prediction_accepted=seq.prediction_accepted, prediction_rejected=seq.prediction_rejected)

    # --- offline use ----------------------------------------------------------------------------
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[list[int]]:
        """Run prompts to completion together; returns each one's generated token ids."""
        plist = params if isinstance(params, list) else [params] * len(prompts)
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, plist)]
        out: dict[str, list[int]] = {i: [] for i in ids}
        while self.has_work():
            for o in self.step():
                if o.new_token is not None and o.request_id in out:
                    out[o.request_id].append(o.new_token)
        return [out[i] for i in ids]
