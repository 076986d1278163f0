"""ModelRunner: turns a step plan into tensors, runs the forward pass, samples on the device.

A step is launched (its device work queued, its results' copy to the host queued behind it) and collected
later (one wait, one transfer: the sampled token ids, and logprobs if asked). In between, the engine may
launch the next decode step, whose input tokens are the ones this step samples, read on the device: the
host's work for one step then overlaps the GPU's for the other (engine.py, "overlapped steps").
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field

import torch

from cobatch.batch import AttentionMetadata
from cobatch.engine.grammar import allowed_masks
from cobatch.engine.kv_cache import KVPool
from cobatch.engine.sampler import (MAX_BAD_WORD_TOKENS, Sampler, SampleOutput, SampleRow, bad_word_bans,
                                    needs_penalties, to_device)
from cobatch.engine.scheduler import StepPlan
from cobatch.kernels.attention import prefill_work


# A prompt token reported with its logprob: (token, logprob, the k likeliest (token, logprob), its rank: 1 + the
# tokens more likely than it)
PromptLogprob = tuple[int, float, list[tuple[int, float]], int]


@dataclass(slots=True)
class StepResult:
    """Per planned sequence: the sampled token (None if its prefill chunk did not reach the end), and the
    logprobs of the prompt tokens this step's rows predict, for sequences that asked for them, and the final
    hidden state of the last prompt token, for sequences that asked for an embedding."""
    tokens: list[int | None]
    logprobs: list[float | None]
    top: list[list[tuple[int, float]] | None]
    prompt_logprobs: list[list[PromptLogprob] | None] | None = None
    embeddings: list[list[float] | None] | None = None     # params.embed: the last prompt row's hidden state
    # A sequence with drafts (seq.draft): the (token, logprob, top) sampled at each draft row, in order
    drafted: list[list[tuple[int, float | None, list[tuple[int, float]] | None]] | None] | None = None
    mirostat_mu: list[float | None] | None = None     # a mirostat sequence's state after this step's token


@dataclass(slots=True, eq=False)
class LaunchedStep:
    """A step whose device work is queued. `samplers`: (index in plan.items, drafts) of the planned sequences
    that sample, in the order of `out`'s rows (a speculating sequence: its last row, then one per draft); taken
    at launch, since a sequence's state moves on before a step planned ahead is collected. `host`/`ready`: the
    pinned buffer the results are copied into, and the event that says they are there (None on the CPU)."""
    plan: StepPlan
    samplers: list[tuple[int, int]] = field(default_factory=list)
    rows: list[SampleRow] = field(default_factory=list)
    out: SampleOutput | None = None
    host: torch.Tensor | None = None
    ready: torch.cuda.Event | None = None
    prompt_logprobs: list[list[PromptLogprob] | None] | None = None
    embeddings: torch.Tensor | None = None      # float32 [rows that asked, d_model], on the device

    def sampling_seqs(self) -> list:
        return [self.plan.items[i][0] for i, _ in self.samplers]

    def row_of(self) -> dict[int, int]:
        """id(sequence) -> the row of `out` holding the token it sampled (its first, if it had drafts)."""
        rows, row = {}, 0
        for i, drafts in self.samplers:
            rows[id(self.plan.items[i][0])] = row
            row += 1 + drafts
        return rows


def _samples(seq, n: int) -> bool:
    """Do the n rows a step gives this sequence reach its last token (and any drafts), so that it samples?"""
    return seq.num_computed + n == len(seq.token_ids) + len(seq.draft)


def step_metadata(slots: list[int], starts: list[int], lens: list[int], tables: list[list[int]],
                  device: torch.device) -> AttentionMetadata:
    """An eager step's attention metadata from its host lists (ModelRunner._host_inputs): pinned, non-blocking
    copies, so the host does not wait here for a step still running on the device. A step with a chunk of several
    rows gets the prefill kernels' work list (attention.prefill_work), so that their programs are its tiles, not
    every sequence times the longest chunk's."""
    width = max(len(t) for t in tables)
    max_query_len = max(b - a for a, b in zip(starts, starts[1:]))
    return AttentionMetadata(
        slot_mapping=to_device(slots, torch.int64, device),
        query_start=to_device(starts, torch.int32, device),
        seq_lens=to_device(lens, torch.int32, device),
        block_tables=to_device([t + [0] * (width - len(t)) for t in tables], torch.int32, device),
        max_query_len=max_query_len,
        max_seq_len=max(lens),
        prefill_work=to_device(prefill_work(starts, lens), torch.int32, device) if max_query_len > 1 else None,
    )


class ModelRunner:
    def __init__(self, model, pool: KVPool, device: torch.device, stop_ids: frozenset[int] = frozenset()):
        self.model, self.pool, self.device = model, pool, device
        self.ends_of_turn = tuple(sorted(stop_ids))     # banned for a row that has not reached min_tokens
        self.sampler = Sampler()
        self.block_size = pool.block_size
        self.graphs = None          # DecodeGraphs (CUDA only), set by LLM.load
        self.step_graphs = None     # StepGraphs (CUDA only), set by LLM.load

    def _host_inputs(self, plan: StepPlan) -> tuple[list[int], list[int], list[int], list[int], list[int],
                                                    list[list[int]], list[int]]:
        """A step's token ids, positions, KV slots (a row each), each sequence's first row (and the rows in all),
        lengths and block tables, and the rows that sample, as host lists."""
        bs, ahead = self.block_size, plan.ahead
        ids, pos, slots, starts, lens, tables, sample_rows = [], [], [], [0], [], [], []
        for i, (seq, n) in enumerate(plan.items):
            first = plan.first_position(i)
            ids.extend(seq.token_ids[first:first + n])
            ids.extend(seq.draft)           # (a speculating sequence's n rows: its last token, then its drafts)
            positions = range(first, first + n)
            pos.extend(positions)
            slots.extend(seq.block_table[p // bs] * bs + p % bs for p in positions)
            # A speculating sequence's rows (its last token, then its drafts) are one causal query here, read
            # once per layer; the decode graph runs them as rows of their own instead (_graph_logits).
            starts.append(starts[-1] + n)
            lens.append(first + n)
            tables.append(seq.block_table)
            if ahead or _samples(seq, n):   # the last row, and each draft's
                sample_rows.extend(range(starts[-1] - 1 - len(seq.draft), starts[-1]))
        return ids, pos, slots, starts, lens, tables, sample_rows

    def _forward(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """The step's final hidden states (through a prefill graph where one holds the step, else eagerly), and
        the rows that sample."""
        if self._use_step_graph(plan):
            ids, pos, slots, starts, lens, tables, sample_rows = self._host_inputs(plan)
            return self.step_graphs.run(ids, pos, slots, lens, starts, tables), sample_rows
        token_ids, positions, meta, sample_rows = self._inputs(plan)
        return self.model.forward(token_ids, positions, meta, self.pool.k, self.pool.v), sample_rows

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        """An eager step's input tokens, positions and attention metadata on the device, and the rows that sample."""
        ids, pos, slots, starts, lens, tables, sample_rows = self._host_inputs(plan)
        dev = self.device
        meta = step_metadata(slots, starts, lens, tables, dev)
        token_ids = self._followed_tokens(plan) if plan.ahead else to_device(ids, torch.int64, dev)
        return token_ids, to_device(pos, torch.int64, dev), meta, sample_rows

    def _use_step_graph(self, plan: StepPlan) -> bool:
        """A step with a prefill chunk, of its own tokens (not planned ahead), without drafts, that a prefill
        graph's bucket holds. Decoders alone run as decode steps (graphs or eager) whatever graphs exist: the
        prefill graphs' attention would give their rows other bits than decode attention does."""
        return (self.step_graphs is not None and not plan.ahead and all(not seq.draft for seq, _ in plan.items)
                and any(not seq.is_decoding for seq, _ in plan.items)
                and self.step_graphs.bucket_for(sum(n for _, n in plan.items), len(plan.items)) is not None)

    def _followed_tokens(self, plan: StepPlan) -> torch.Tensor:
        """The input tokens of a step planned ahead: the ones the step it follows samples, on the device."""
        return self._followed(plan, plan.follows.out.token_ids)

    def _followed(self, plan: StepPlan, values: torch.Tensor) -> torch.Tensor:
        """One value a row of the step `plan` follows (its sampled tokens, its mirostat states), in the rows of
        `plan`, on the device."""
        row_of = plan.follows.row_of()
        index = [row_of[id(seq)] for seq, _ in plan.items]
        if index == list(range(len(index))):
            return values[:len(index)]
        return values.index_select(0, to_device(index, torch.int64, self.device))

    def _graph_logits(self, plan: StepPlan) -> torch.Tensor:
        """A decode step through the captured graph (its inputs are staged by DecodeGraphs). A speculating
        sequence's drafts are decode rows of their own after its last token, at the positions that follow it,
        each seeing the rows before it through the KV they write in the same layer: so each row computes what
        plain decoding computes for that token (bitwise, up to decode attention's invariant_rows)."""
        bs, ahead = self.block_size, plan.ahead
        ids, pos, tables = [], [], []
        for i, (seq, n) in enumerate(plan.items):
            first = plan.first_position(i)
            ids.append(seq.token_ids[first] if not ahead else 0)     # ahead: the device's, copied in below
            ids.extend(seq.draft)
            pos.extend(range(first, first + n))
            tables.extend([seq.block_table] * n)
        return self.graphs.run(token_ids=ids, positions=pos,
                               slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(tables, pos)],
                               block_tables=tables, device_token_ids=self._followed_tokens(plan) if ahead else None)

    def _use_graph(self, plan: StepPlan) -> bool:
        """Decoders only (each its last token, and its drafts if it speculates), within the graphs' rows. A
        plan made ahead is one decode row per sequence by construction (the host's state lags it)."""
        if self.graphs is None or sum(n for _, n in plan.items) > self.graphs.max_batch:
            return False
        return bool(plan.ahead) or all(n == 1 + len(seq.draft) and seq.pending == 1 and not seq.params.embed
                                       for seq, n in plan.items)

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> LaunchedStep:
        """Queue a step's forward pass, its sampling and the copy of its results to the host; wait for none of
        it (except where prompt logprobs are asked: those are read back here). A plan made ahead
        (plan.follows) reads its input tokens from the step it follows, on the device."""
        step = LaunchedStep(plan, samplers=[(i, len(seq.draft)) for i, (seq, n) in enumerate(plan.items)
                                            if plan.ahead or _samples(seq, n)])
        lora = getattr(self.model, "lora", None)
        if lora is not None:        # each row's adapter, where the forward (or the graph replayed) reads them
            lora.stage(to_device([seq.adapter for seq, n in plan.items for _ in range(n)], torch.int64, self.device))
        if self._use_graph(plan):
            logits = self._graph_logits(plan)
        else:
            hidden, sample_rows = self._forward(plan)
            if not plan.ahead:              # (a row planned ahead is past its prompt)
                step.prompt_logprobs = self._prompt_logprobs(plan, hidden)
            if not step.samplers:
                return step
            last = hidden[to_device(sample_rows, torch.int64, hidden.device)]
            # params.embed: the final-normed hidden state of the last prompt token, copied once the step syncs
            first_rows = itertools.accumulate((1 + drafts for _, drafts in step.samplers), initial=0)
            want = [row for row, seq in zip(first_rows, step.sampling_seqs()) if seq.params.embed]
            if want:
                step.embeddings = last[to_device(want, torch.int64, last.device)].float()
            logits = self.model.logits(last)
        step.rows = self._sample_rows(step.sampling_seqs(), plan.ahead)
        # a step planned ahead: the histories (and mirostat states) the host gives its rows lack what the step
        # before samples; the device has them
        pending = pending_mu = None
        if plan.ahead:
            pending = self._followed_tokens(plan)
            if plan.follows.out.mirostat_mu is not None:
                pending_mu = self._followed(plan, plan.follows.out.mirostat_mu)
        step.out = self.sampler(logits, step.rows, pending, pending_mu)
        self._start_transfer(step)
        return step

    def collect(self, step: LaunchedStep) -> StepResult:
        """Wait for a launched step's results and return them (the step's one host sync)."""
        if step.out is None:
            none = [None] * len(step.plan.items)
            return StepResult(none, none, none, step.prompt_logprobs)
        if step.ready is not None:
            step.ready.synchronize()
        result = self._unpack(step)
        result.prompt_logprobs = step.prompt_logprobs
        if step.embeddings is not None:      # in plan order: the rows whose prompt ends this step and that asked
            vectors = iter(step.embeddings.tolist())
            result.embeddings = [None] * len(step.plan.items)
            for i, _ in step.samplers:
                if step.plan.items[i][0].params.embed:
                    result.embeddings[i] = next(vectors)
        return result

    def _prompt_logprobs(self, plan: StepPlan, hidden: torch.Tensor) -> list[list[PromptLogprob] | None] | None:
        """For sequences that asked (params.prompt_logprobs): row p of the chunk predicts prompt token p + 1.
        Tokens an earlier step reported (before a preemption, say) are not reported again. The last prompt
        row predicts the first sampled token, whose logprob is the ordinary one."""
        if all(seq.params.prompt_logprobs is None for seq, _ in plan.items):
            return None
        out: list[list[PromptLogprob] | None] = []
        row0 = 0
        for seq, n in plan.items:
            k, first = seq.params.prompt_logprobs, seq.num_computed
            positions = [p for p in range(first, first + n) if seq.num_prompt_logprobs < p + 1 < seq.prompt_len]
            if k is None or not positions:
                out.append(None if k is None else [])
                row0 += n
                continue
            index = torch.tensor([row0 + p - first for p in positions], device=hidden.device)
            log_probs = torch.log_softmax(self.model.logits(hidden[index]).float(), dim=-1)
            targets = torch.tensor([seq.token_ids[p + 1] for p in positions], device=hidden.device)
            chosen = log_probs.gather(1, targets[:, None])
            ranks = ((log_probs > chosen).sum(dim=-1) + 1).tolist()
            top_lp, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
            out.append([(seq.token_ids[p + 1], lp, list(zip(ids, lps)), rank) for p, lp, ids, lps, rank
                        in zip(positions, chosen[:, 0].tolist(), top_ids.tolist(), top_lp.tolist(), ranks)])
            row0 += n
        return out

    def _sample_rows(self, seqs: list, ahead: int = 0) -> list[SampleRow]:
        """What the sampler needs of each sequence. Runs while the device computes the step's logits, so
        the grammar masks (host work, in parallel over the constrained rows) overlap the GPU. ahead = 1: the
        step was planned before the host saw each sequence's last token (engine.py: only for sequences whose
        sampling does not read their tokens), so it counts that token."""
        matchers = [seq.matcher for seq in seqs if seq.matcher is not None]
        masks = iter(allowed_masks(matchers) if matchers else ())      # in the order of the constrained rows
        rows = []
        for seq in seqs:
            # Token histories are copied only for rows whose penalties read them: at B=128 x 4k context the
            # copies alone cost milliseconds per step.
            history = needs_penalties(seq.params)
            rows.append(SampleRow(params=seq.params, seed=seq.seed, step=seq.num_output + ahead,
                                  prompt_ids=seq.token_ids[:seq.prompt_len] if history else (),
                                  output_ids=seq.output_ids if history else (),
                                  allowed=next(masks) if seq.matcher is not None else None,
                                  banned=self._banned(seq, ahead), mirostat_mu=seq.mirostat_mu))
            # Draft rows (speculative.can_speculate: nothing here depends on the tokens before them) draw
            # with the steps plain decoding would give those tokens.
            rows.extend(SampleRow(params=seq.params, seed=seq.seed, step=seq.num_output + j, prompt_ids=(),
                                  output_ids=()) for j in range(1, len(seq.draft) + 1))
        return rows

    def _banned(self, seq, ahead: int = 0) -> tuple[int, ...]:
        """Ends of turn before min_tokens, and the tokens that would complete a bad word."""
        params = seq.params
        banned = ()
        if seq.num_output + ahead < params.min_tokens:
            banned = (() if params.ignore_eos else self.ends_of_turn) + tuple(params.stop_token_ids)
        if params.bad_words:     # the output's tail is all a word can match (no copy of a long history)
            tail = seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - MAX_BAD_WORD_TOKENS):]
            banned += bad_word_bans(params.bad_words, tail)
        return banned

    @staticmethod
    def _start_transfer(step: LaunchedStep) -> None:
        """Queue the copy of the step's results to the host, in one buffer (token ids travel as float32, exact
        below 2**24, which every vocabulary we load is)."""
        out, n = step.out, len(step.rows)
        tensors = [out.token_ids.float()]
        if out.logprobs is not None:
            tensors += [out.logprobs.float(), out.top_ids.float(), out.top_logprobs.float()]
        if out.mirostat_mu is not None:
            tensors.append(out.mirostat_mu)          # the last column
        packed = torch.cat([t.reshape(n, -1) for t in tensors], dim=1)
        if packed.is_cuda:
            step.host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
            step.host.copy_(packed, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        else:
            step.host = packed

    @staticmethod
    def _unpack(step: LaunchedStep) -> StepResult:
        out, rows, items = step.out, step.rows, step.plan.items
        host = step.host.tolist()
        result = StepResult([None] * len(items), [None] * len(items), [None] * len(items))

        def sampled(j: int) -> tuple[int, float | None, list[tuple[int, float]] | None]:
            row, logprob, top = host[j], None, None
            if out.logprobs is not None:
                k, want = out.top_ids.shape[1], rows[j].params.logprobs
                logprob = row[1]
                if want is not None:
                    top = [(int(t), lp) for t, lp in zip(row[2:2 + k], row[2 + k:2 + 2 * k])][:want]
            return int(row[0]), logprob, top

        if out.mirostat_mu is not None:
            result.mirostat_mu = [None] * len(items)
        j = 0
        for i, drafts in step.samplers:
            result.tokens[i], result.logprobs[i], result.top[i] = sampled(j)
            if out.mirostat_mu is not None and not math.isnan(host[j][-1]):
                result.mirostat_mu[i] = host[j][-1]
            j += 1
            if drafts:
                if result.drafted is None:
                    result.drafted = [None] * len(items)
                result.drafted[i] = [sampled(j + d) for d in range(drafts)]
                j += drafts
        return result
