"""Which data-parallel replica a request goes to: the one caching the longest prefix of its prompt, else the
least loaded.

The front keeps, per replica, the chained block hashes (engine/kv_cache.chain_hash, the prefix cache's own) of the
prompts it sent there, most recent last and at most as many as the replica's KV pool has blocks (what it can still
hold). A prompt's hashes are looked up in order: the run of leading hits is the prefix that replica has cached, as
far as the front can know (the replica may have evicted it; then it computes it again, nothing breaks). The
longest prefix wins when it covers at least `min_affinity` of the prompt's full blocks -- a short system prompt
every request shares must not pull them all onto one replica (SGLang's cache-aware router has the same
threshold) -- and when that replica is not more than `max_imbalance` requests busier than the least loaded one.
Otherwise, and between equals, the least loaded (requests in flight) wins, then the lowest index.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field

from cobatch.engine.kv_cache import chain_hash


def prompt_block_hashes(token_ids: list[int], block_size: int, root: int | None = None) -> list[int]:
    """The chained hashes of a prompt's full blocks, as the replica's prefix cache names them (root: where a salted
    request's chains start, kv_cache.salted_root)."""
    hashes, prev = [], root
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        prev = chain_hash(prev, tuple(token_ids[start:start + block_size]))
        hashes.append(prev)
    return hashes


@dataclass
class ReplicaState:
    capacity_blocks: int
    in_flight: int = 0
    routed: dict[str, int] = field(default_factory=lambda: {"prefix": 0, "load": 0})
    blocks: OrderedDict = field(default_factory=OrderedDict)      # hash -> None, least recently sent first

    def cached_prefix(self, hashes: list[int]) -> int:
        """How many of the leading blocks this replica holds, as far as the front knows."""
        n = 0
        for h in hashes:
            if h not in self.blocks:
                break
            n += 1
        return n

    def remember(self, hashes: list[int]) -> None:
        for h in hashes:
            self.blocks[h] = None
            self.blocks.move_to_end(h)
        while len(self.blocks) > self.capacity_blocks:
            self.blocks.popitem(last=False)


class PrefixRouter:
    def __init__(self, n_replicas: int, block_size: int = 16, capacity_blocks: int = 1 << 16,
                 min_affinity: float = 0.5, max_imbalance: int = 8):
        self.block_size, self.min_affinity, self.max_imbalance = block_size, min_affinity, max_imbalance
        self.replicas = [ReplicaState(capacity_blocks) for _ in range(n_replicas)]

    def choose(self, token_ids: list[int] | None, root: int | None = None) -> tuple[int, list[int]]:
        """(the replica for a prompt, its block hashes); None: a request with no prompt to match (load only).
        root: a salted request's (its blocks match only its salt's). The caller counts the request in flight
        (start) and out (finish)."""
        hashes = prompt_block_hashes(token_ids, self.block_size, root) if token_ids else []
        least = min(range(len(self.replicas)), key=lambda i: (self.replicas[i].in_flight, i))
        if hashes:
            hits = [r.cached_prefix(hashes) for r in self.replicas]
            best = max(range(len(self.replicas)), key=lambda i: (hits[i], -self.replicas[i].in_flight, -i))
            if (hits[best] >= self.min_affinity * len(hashes) and hits[best] > 0
                    and self.replicas[best].in_flight - self.replicas[least].in_flight <= self.max_imbalance):
                self.replicas[best].routed["prefix"] += 1
                return best, hashes
        self.replicas[least].routed["load"] += 1
        return least, hashes

    def start(self, replica: int, hashes: list[int]) -> None:
        state = self.replicas[replica]
        state.in_flight += 1
        state.remember(hashes)

    def finish(self, replica: int) -> None:
        self.replicas[replica].in_flight -= 1
