"""Step planning: which sequences run in the next forward pass, and how many rows each gets.

Every decoding sequence advances by one token in every step (they are the latency-critical ones);
prefill chunks fill the rest of the step's token budget, oldest request first, so a long prompt is
sliced over several steps instead of stalling the streams that are already decoding.

Two policies, as vLLM's --scheduling-policy: "fcfs" (first come, first served) and "priority", where a request's
SamplingParams.priority orders it (lower first, then arrival): the waiting queue is kept in that order, a step's
rows go to the most urgent first, and out of KV blocks the least urgent running sequence gives its blocks back
(it recomputes its tokens later, the prefix cache sparing most of them). As in vLLM, a running request is not
interrupted to make room for a more urgent one.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from cobatch.engine.kv_cache import BlockManager
from cobatch.engine.sequence import Sequence, SeqStatus


@dataclass(slots=True)
class StepPlan:
    items: list[tuple[Sequence, int]] = field(default_factory=list)   # (sequence, rows this step)
    # A plan made ahead (plan_ahead): one decode row per sequence, for the token that the launched step
    # `follows` samples. Each sequence's host state is behind: by behind[i] rows of K/V (the rows `follows`
    # gives it: 1, or a prompt's last chunk) and by one sampled token.
    follows: object | None = None
    behind: list[int] = field(default_factory=list)

    @property
    def ahead(self) -> int:
        """Sampled tokens each sequence has that its host state lacks: 1 for a plan made ahead, else 0."""
        return 0 if self.follows is None else 1

    def first_position(self, i: int) -> int:
        """The position of item i's first row (past the rows in flight, for a plan made ahead)."""
        return self.items[i][0].num_computed + (self.behind[i] if self.follows is not None else 0)

    @property
    def num_rows(self) -> int:
        return sum(n for _, n in self.items)

    @property
    def is_decode_only(self) -> bool:
        return all(seq.is_decoding and n == 1 for seq, n in self.items)


@dataclass(slots=True)
class DecodeStats:
    """How often decode actually batched, and why it did not (the ds4 batch-diag counters); the rows steps ran."""
    steps: int = 0               # planned steps with at least one row
    rows: int = 0                # ... and their rows (decode rows, drafts and prefill chunks)
    widest_step: int = 0         # the most rows one step ran
    decode_steps: int = 0
    batched_steps: int = 0
    lone_peer_prefill: int = 0   # the only decoder had a peer still prefilling
    lone_peer_finish: int = 0    # a peer finished in the previous step
    lone_no_peer: int = 0        # nobody else to batch with
    preemptions: int = 0
    draft_tokens: int = 0        # speculative tokens proposed (engine/speculative.py)
    accepted_tokens: int = 0     # ... and kept


SCHEDULING_POLICIES = ("fcfs", "priority")


class Scheduler:
    def __init__(self, blocks: BlockManager, max_num_seqs: int, max_step_tokens: int, prefill_chunk: int,
                 draft: Callable[[Sequence, int], list[int]] | None = None, draft_rows: int | None = None,
                 draft_max_running: int | None = None,
                 prepare_drafts: Callable[[list[Sequence], int], None] | None = None, policy: str = "fcfs"):
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling policy must be one of {', '.join(SCHEDULING_POLICIES)} (got {policy!r})")
        self.blocks = blocks
        self.policy = policy
        self.draft = draft           # speculative drafts of a decoding sequence, at most the int given
        self.prepare_drafts = prepare_drafts     # called with the step's decoders before `draft` asks for theirs
        self.draft_rows = draft_rows     # most rows a step with drafts may have (None: the token budget)
        self.draft_max_running = draft_max_running   # no drafts while more sequences than this run (None: any)
        self.max_num_seqs = max_num_seqs
        self.max_step_tokens = max_step_tokens
        self.prefill_chunk = prefill_chunk
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.stats = DecodeStats()
        self._finished_last_step = 0
        self._arrivals = itertools.count()

    @property
    def by_priority(self) -> bool:
        return self.policy == "priority"

    @staticmethod
    def urgency(seq: Sequence) -> tuple[int, int]:
        """The priority policy's order: lower first (its priority, then its arrival)."""
        return seq.params.priority, seq.arrival_order

    def add(self, seq: Sequence) -> None:
        seq.arrival_order = next(self._arrivals)
        self._enqueue(seq, front=False)

    def _enqueue(self, seq: Sequence, front: bool) -> None:
        """Into the waiting queue: by urgency under the priority policy, else at the back (a newcomer) or the
        front (a preempted sequence, which arrived before every waiting one)."""
        if self.by_priority:
            key = self.urgency(seq)
            self.waiting.insert(next((i for i, s in enumerate(self.waiting) if self.urgency(s) > key),
                                     len(self.waiting)), seq)
        elif front:
            self.waiting.appendleft(seq)
        else:
            self.waiting.append(seq)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _admit(self) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            seq = self.waiting[0]
            # Prompt logprobs need every prompt row computed: no prefix-cache reuse for those requests.
            if seq.num_computed == 0 and not seq.block_table and seq.params.prompt_logprobs is None:
                matched = self.blocks.match_prefix(seq.token_ids, seq.hash_root)
                seq.block_table = matched
                seq.num_computed = len(matched) * self.blocks.block_size
                seq.block_hashes = [self.blocks.blocks[b].hash for b in matched]
                if seq.num_output == 0:
                    seq.num_cached_prompt = seq.num_computed
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            self.running.append(seq)

    def _ensure_blocks(self, seq: Sequence, n_tokens: int) -> bool:
        need = -(-(seq.num_computed + n_tokens) // self.blocks.block_size) - len(seq.block_table)
        if need <= 0:
            return True
        got = self.blocks.allocate(need)
        if got is None:
            return False
        seq.block_table.extend(got)
        return True

    def preempt(self, seq: Sequence) -> None:
        """Give a sequence's blocks back; it recomputes its tokens later (prefix cache may spare some)."""
        self.running.remove(seq)
        self.free(seq)
        seq.num_computed = 0
        seq.draft = []
        seq.status = SeqStatus.WAITING
        self._enqueue(seq, front=True)
        self.stats.preemptions += 1

    def free(self, seq: Sequence) -> None:
        self.blocks.release(seq.block_table)
        seq.block_table, seq.block_hashes = [], []

    def drafts_each(self, order: list[Sequence], all_decoding: bool = False) -> int:
        """Drafts each decoder may propose this step: the rows left once every running sequence has one,
        shared equally among the decoders (so the first ones do not take them all). all_decoding: count every
        sequence as a decoder (the step after one that ends their prompts)."""
        decoders = len(order) if all_decoding else sum(seq.is_decoding for seq in order)
        too_many = self.draft_max_running is not None and len(order) > self.draft_max_running
        if self.draft is None or not decoders or too_many:
            return 0
        rows = self.max_step_tokens if self.draft_rows is None else min(self.draft_rows, self.max_step_tokens)
        return max(0, rows - len(order)) // decoders

    def plan(self) -> StepPlan:
        self._admit()
        plan = StepPlan()
        budget = self.max_step_tokens
        # Decoders first, in admission order (by urgency under the priority policy); then prefill chunks so.
        running = sorted(self.running, key=self.urgency) if self.by_priority else self.running
        order = [s for s in running if s.is_decoding] + [s for s in running if not s.is_decoding]
        drafts_each = self.drafts_each(order)
        if drafts_each > 0 and self.prepare_drafts is not None:
            self.prepare_drafts([s for s in order if s.is_decoding], drafts_each)
        for seq in order:
            if seq.status is not SeqStatus.RUNNING:      # preempted while planning this step
                continue
            seq.draft = []
            if seq.is_decoding:
                if drafts_each > 0:
                    seq.draft = self.draft(seq, drafts_each)
                rows = 1 + len(seq.draft)
            else:
                rows = min(seq.pending, self.prefill_chunk, budget)
                if rows < seq.pending:
                    # A prompt cut here anyway ends the step on a multiple of prefill_chunk rows: the size of a
                    # prefill step's graph (engine/cuda_graphs.StepGraphs), which the decode rows before it
                    # would otherwise push into the next size up, mostly padding.
                    past = (self.max_step_tokens - budget + rows) % self.prefill_chunk
                    rows -= min(rows - 1, past)
            if rows <= 0:
                continue
            while not self._ensure_blocks(seq, rows):
                victim = self._victim(seq, plan)        # out of KV: push someone back (at worst this one)
                self.preempt(victim)
                if victim is seq:
                    break
            if seq.status is not SeqStatus.RUNNING:
                seq.draft = []
                continue
            plan.items.append((seq, rows))
            self.stats.draft_tokens += len(seq.draft)
            budget -= rows
        self._count(plan)
        return plan

    def _victim(self, seq: Sequence, plan: StepPlan) -> Sequence:
        """Out of KV for seq: whom to push back, among the running sequences not already in this step, or seq
        itself. The newest (fcfs), or the least urgent (priority: seq itself if it is the least urgent)."""
        planned = {id(s) for s, _ in plan.items}
        others = [s for s in self.running if s is not seq and id(s) not in planned]
        if self.by_priority:
            return max(others + [seq], key=self.urgency)
        return others[-1] if others else seq

    def plan_ahead(self, seqs: list[Sequence], follows: object) -> StepPlan | None:
        """The next decode step of `seqs` (each of which samples its next token in the launched step `follows`:
        a decoder, or a prompt's last chunk), planned before that token reaches the host. None where it would need
        a preemption: the caller then collects the step in flight and plans as usual."""
        plan = StepPlan(follows=follows)
        rows = {id(seq): n for seq, n in follows.plan.items}
        for seq in seqs:
            # Blocks for the rows in flight and for the one this step adds after them.
            if not self._ensure_blocks(seq, rows[id(seq)] + 1):
                return None
            plan.items.append((seq, 1))
            plan.behind.append(rows[id(seq)])
        self._count(plan)
        return plan

    def _count(self, plan: StepPlan) -> None:
        if plan.items:
            self.stats.steps += 1
            self.stats.rows += plan.num_rows
            self.stats.widest_step = max(self.stats.widest_step, plan.num_rows)
        # (A plan made ahead decodes every sequence, some of them before the host has seen their first token.)
        decoders = len(plan.items) if plan.ahead else sum(1 for seq, _ in plan.items if seq.is_decoding)
        if decoders == 0:
            return
        self.stats.decode_steps += 1
        if decoders > 1:
            self.stats.batched_steps += 1
        elif len(plan.items) > 1 or self.waiting:
            self.stats.lone_peer_prefill += 1
        elif self._finished_last_step:
            self.stats.lone_peer_finish += 1
        else:
            self.stats.lone_no_peer += 1

    def finished(self, seq: Sequence) -> None:
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.free(seq)
        seq.status = SeqStatus.FINISHED

    def end_step(self, n_finished: int) -> None:
        self._finished_last_step = n_finished
