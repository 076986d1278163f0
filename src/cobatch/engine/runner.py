"""ModelRunner: turns a step plan into tensors, runs the forward pass, samples on the device.

One host sync per step: the sampled token ids (and logprobs, if asked) come back in one transfer.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cobatch.batch import AttentionMetadata
from cobatch.engine.grammar import allowed_masks
from cobatch.engine.kv_cache import KVPool
from cobatch.engine.sampler import MAX_BAD_WORD_TOKENS, Sampler, SampleRow, bad_word_bans, needs_penalties
from cobatch.engine.scheduler import StepPlan


# A prompt token's logprob under the model: (token id, logprob, top alternatives as (id, logprob)).
PromptLogprob = tuple[int, float, list[tuple[int, float]]]


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


def _samples(seq, n: int) -> bool:
    """Do the n rows a step gives this sequence reach its last token (and any drafts), so that it samples?"""
    return seq.num_computed + n == len(seq.token_ids) + len(seq.draft)


class ModelRunner:
    def __init__(self, model, pool: KVPool, device: torch.device, stop_ids: frozenset[int] = frozenset()):
        self.model, self.pool, self.device = model, pool, device
        self.ends_of_turn = tuple(sorted(stop_ids))     # banned for a row that has not reached min_tokens
        self.sampler = Sampler()
        self.block_size = pool.block_size
        self.graphs = None          # DecodeGraphs, once capture_graphs() ran (CUDA only)

    def capture_graphs(self, max_batch: int, max_context: int, quiet: bool = False) -> None:
        from cobatch.engine.cuda_graphs import DecodeGraphs
        self.graphs = DecodeGraphs(self.model, self.pool, max_batch, max_context, quiet)

    def _inputs(self, plan: StepPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
        bs = self.block_size
        ids, pos, slots, starts, lens, tables, sample_rows = [], [], [], [0], [], [], []
        for seq, n in plan.items:
            first = seq.num_computed
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
            if _samples(seq, n):            # the last row, and each draft's
                sample_rows.extend(range(starts[-1] - 1 - len(seq.draft), starts[-1]))
        width = max(len(t) for t in tables)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=dev),
            query_start=torch.tensor(starts, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            max_query_len=max(n for _, n in plan.items),
            max_seq_len=max(lens),
        )
        return (torch.tensor(ids, dtype=torch.int64, device=dev), torch.tensor(pos, dtype=torch.int64, device=dev),
                meta, sample_rows)

    def _graph_logits(self, plan: StepPlan) -> torch.Tensor:
        """A decode step through the captured graph (its inputs are staged by DecodeGraphs). A speculating
        sequence's drafts are decode rows of their own after its last token, at the positions that follow it,
        each seeing the rows before it through the KV they write in the same layer: so each row computes what
        plain decoding computes for that token (bitwise, up to decode attention's invariant_rows)."""
        bs = self.block_size
        ids, pos, tables = [], [], []
        for seq, n in plan.items:
            first = seq.num_computed
            ids.append(seq.token_ids[first])
            ids.extend(seq.draft)
            pos.extend(range(first, first + n))
            tables.extend([seq.block_table] * n)
        return self.graphs.run(token_ids=ids, positions=pos,
                               slot_mapping=[t[p // bs] * bs + p % bs for t, p in zip(tables, pos)],
                               block_tables=tables)

    def _use_graph(self, plan: StepPlan) -> bool:
        """Decoders only (each its last token, and its drafts if it speculates), within the graphs' rows."""
        return (self.graphs is not None and sum(n for _, n in plan.items) <= self.graphs.max_batch
                and all(n == 1 + len(seq.draft) and seq.pending == 1 and not seq.params.embed
                        for seq, n in plan.items))

    @torch.inference_mode()
    def execute(self, plan: StepPlan, on_launched: Callable[[], None] | None = None) -> StepResult:
        """Run one step. `on_launched` is called once the step's device work is queued, just before the host
        waits for it: the caller's host work done there overlaps the GPU instead of delaying the launch."""
        samplers = [(seq, n) for seq, n in plan.items if _samples(seq, n)]
        prompt_logprobs = embeddings = None     # decode steps (the graph's) predict no prompt token
        if self._use_graph(plan):
            logits = self._graph_logits(plan)
        else:
            token_ids, positions, meta, sample_rows = self._inputs(plan)
            hidden = self.model.forward(token_ids, positions, meta, self.pool.k, self.pool.v)
            prompt_logprobs = self._prompt_logprobs(plan, hidden)
            if not samplers:
                none = [None] * len(plan.items)
                return StepResult(none, none, none, prompt_logprobs)
            last = hidden[torch.tensor(sample_rows, device=hidden.device)]
            # params.embed: the final-normed hidden state of the last prompt token, copied once the step syncs
            first_rows = itertools.accumulate((1 + len(seq.draft) for seq, _ in samplers), initial=0)
            want = [row for row, (seq, _) in zip(first_rows, samplers) if seq.params.embed]
            if want:
                embeddings = last[torch.tensor(want, device=last.device)].float()
            logits = self.model.logits(last)
        rows = self._sample_rows([seq for seq, _ in samplers])
        out = self.sampler(logits, rows)
        if on_launched is not None:
            on_launched()
        result = self._to_host(plan, out, rows)
        result.prompt_logprobs = prompt_logprobs
        if embeddings is not None:      # in plan order: the rows whose prompt ends this step and that asked
            vectors = iter(embeddings.tolist())
            result.embeddings = [next(vectors) if seq.params.embed and seq.num_computed + n == len(seq.token_ids)
                                 else None for seq, n in plan.items]
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
            chosen = log_probs.gather(1, targets[:, None])[:, 0].tolist()
            top_lp, top_ids = log_probs.topk(k, dim=-1) if k else (log_probs[:, :0], log_probs[:, :0].long())
            out.append([(seq.token_ids[p + 1], lp, list(zip(ids, lps)))
                        for p, lp, ids, lps in zip(positions, chosen, top_ids.tolist(), top_lp.tolist())])
            row0 += n
        return out

    def _sample_rows(self, seqs: list) -> list[SampleRow]:
        """What the sampler needs of each sequence. Runs while the device computes the step's logits, so
        the grammar masks (host work, in parallel over the constrained rows) overlap the GPU."""
        matchers = [seq.matcher for seq in seqs if seq.matcher is not None]
        masks = iter(allowed_masks(matchers) if matchers else ())      # in the order of the constrained rows
        rows = []
        for seq in seqs:
            # Token histories are copied only for rows whose penalties read them: at B=128 x 4k context the
            # copies alone cost milliseconds per step.
            history = needs_penalties(seq.params)
            rows.append(SampleRow(params=seq.params, seed=seq.seed, step=seq.num_output,
                                  prompt_ids=seq.token_ids[:seq.prompt_len] if history else (),
                                  output_ids=seq.output_ids if history else (),
                                  allowed=next(masks) if seq.matcher is not None else None,
                                  banned=self._banned(seq)))
            # Draft rows (speculative.can_speculate: nothing here depends on the tokens before them) draw
            # with the steps plain decoding would give those tokens.
            rows.extend(SampleRow(params=seq.params, seed=seq.seed, step=seq.num_output + j, prompt_ids=(),
                                  output_ids=()) for j in range(1, len(seq.draft) + 1))
        return rows

    def _banned(self, seq) -> tuple[int, ...]:
        """Ends of turn before min_tokens, and the tokens that would complete a bad word."""
        params = seq.params
        banned = ()
        if seq.num_output < params.min_tokens:
            banned = (() if params.ignore_eos else self.ends_of_turn) + tuple(params.stop_token_ids)
        if params.bad_words:     # the output's tail is all a word can match (no copy of a long history)
            tail = seq.token_ids[max(seq.prompt_len, len(seq.token_ids) - MAX_BAD_WORD_TOKENS):]
            banned += bad_word_bans(params.bad_words, tail)
        return banned

    def _to_host(self, plan: StepPlan, out, rows: list[SampleRow]) -> StepResult:
        # The one host sync of the step: everything the caller needs in one transfer (token ids travel
        # as float32, exact below 2**24, which every vocabulary we load is).
        tensors = [out.token_ids.float()]
        if out.logprobs is not None:
            tensors += [out.logprobs.float(), out.top_ids.float(), out.top_logprobs.float()]
        host = torch.cat([t.reshape(len(rows), -1) for t in tensors], dim=1).cpu().tolist()
        result = StepResult([None] * len(plan.items), [None] * len(plan.items), [None] * len(plan.items))

        def sampled(j: int) -> tuple[int, float | None, list[tuple[int, float]] | None]:
            row, logprob, top = host[j], None, None
            if out.logprobs is not None:
                k, want = out.top_ids.shape[1], rows[j].params.logprobs
                logprob = row[1]
                if want is not None:
                    top = [(int(t), lp) for t, lp in zip(row[2:2 + k], row[2 + k:2 + 2 * k])][:want]
            return int(row[0]), logprob, top

        j = 0
        for i, (seq, n) in enumerate(plan.items):
            if not _samples(seq, n):
                continue
            result.tokens[i], result.logprobs[i], result.top[i] = sampled(j)
            j += 1
            if seq.draft:
                if result.drafted is None:
                    result.drafted = [None] * len(plan.items)
                result.drafted[i] = [sampled(j + d) for d in range(len(seq.draft))]
                j += len(seq.draft)
        return result
