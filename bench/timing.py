"""GPU time of the kernels in a CUDA graph: the timing every kernel benchmark here uses (GPU only).

A benchmark captures R calls of a kernel (on rotating inputs bigger than L2) in one graph, times replays with
CUDA events and divides by R. Replayed onto an idle stream, the start event is stamped at once, and the graph's
first kernel starts only when the host has finished submitting the graph, and that submission was charged to
the kernels. A decode step pays it once per ~300 kernels, and with overlapped steps while the step before it runs.
So each replay here is queued behind a GPU sleep that outlasts the submission: the events then bracket the
graph's execution only (its kernels' launches inside the graph included, as a decode step has them).
`idle` keeps the old figure (replays onto an idle stream) for comparison: on the H200 it read 0-4 % slower
(docs/kernels.md).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

import torch

# Clock cycles of the sleep queued before each timed replay: ~0.5 ms at the H200's 1.98 GHz, far longer
# than submitting a graph of a few hundred nodes.
SLEEP_CYCLES = 1_000_000


@dataclass(frozen=True)
class GraphTime:
    queued: float      # seconds per call, the graph queued behind a busy GPU (the figure benchmarks report)
    idle: float        # seconds per call, replayed onto an idle stream (host submission included)


def replay_seconds(graph: torch.cuda.CUDAGraph, reps: int, queued: bool = True) -> float:
    """Median seconds of one replay of a captured (and once replayed) graph."""
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if queued:
            torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def captured(launches) -> torch.cuda.CUDAGraph:
    """All launches run once eagerly (compile), then captured in one graph, replayed once (upload)."""
    for f in launches:
        f()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for f in launches:
            f()
    graph.replay()
    torch.cuda.synchronize()
    return graph


def graph_times(launches, reps: int = 15) -> GraphTime:
    """Seconds per launch, both ways (for result tables that keep the idle-stream figure beside the other)."""
    graph = captured(launches)
    return GraphTime(queued=replay_seconds(graph, reps) / len(launches),
                     idle=replay_seconds(graph, reps, queued=False) / len(launches))


def graph_time(launches, reps: int = 15) -> float:
    """Seconds per launch, the graph queued behind a busy GPU (sweeps: no idle-stream replays)."""
    return replay_seconds(captured(launches), reps) / len(launches)


COPY_DETAIL: dict = {}


def copy_bandwidth() -> float:
    """GB/s of a 2 GiB device-to-device copy, counting bytes read plus bytes written, best of two ways:
    an SM kernel (torch.mul by 1) and copy_ (a memcpy; inside a CUDA graph it becomes a memcpy node, which
    read only 2.7 TB/s in the first runs, so it cannot be the ceiling alone). Best of 3 after a warm-up."""
    src = torch.randn(512 << 20, device="cuda")
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    ways = {"sm_kernel": lambda: torch.mul(src, 1.0, out=dst), "memcpy": lambda: dst.copy_(src)}
    for f in ways.values():
        for _ in range(50):
            f()
    torch.cuda.synchronize()
    for name, f in ways.items():
        COPY_DETAIL[name] = nbytes / min(graph_time([f] * 8, reps=10) for _ in range(3)) / 1e9
    del src, dst
    return max(COPY_DETAIL.values())
