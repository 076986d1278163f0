"""Start a tensor-parallel model: spawn ranks 1..N-1, join them as rank 0, and watch them.

`load(path, options)` is LLM.load for any --tensor-parallel-size: with 1 it is exactly LLM.load. With N it
checks the model splits (one error line before anything loads), starts N - 1 processes (forked from a clean
forkserver process, so CUDA starts fresh in each), and they rendezvous with this one on a free port of
127.0.0.1. Each loads its own shard and follows rank 0's steps (parallel.steps).

A rank that fails brings the whole server down with one line: a rank that raises prints its error and exits;
rank 0's watchdog sees any rank's process end (whatever killed it) and ends rank 0 at once, naming the rank (a
collective in flight would otherwise wait for the group's timeout). A rank whose rank 0 is gone sees its pipe
close and exits.
"""

from __future__ import annotations

import atexit
import multiprocessing
import multiprocessing.connection
import os
import socket
import sys
import threading
from pathlib import Path

import torch

from cobatch.config import ModelConfig
from cobatch.errors import UserError
from cobatch.llm import LLM, EngineOptions, load_rank, resolve_device
from cobatch.loader.gguf import GGUFFile
from cobatch.loader.metadata_overrides import apply_overrides
from cobatch.model_files import default_model_path
from cobatch.parallel.group import TensorParallelGroup
from cobatch.parallel.shard import check_tensor_parallel
from cobatch.parallel.steps import StepLink, follow_steps

RANK_REPORTED_EXIT = 3      # a rank's exit code after it printed its own error line


def check(path: str | Path | None, options: EngineOptions) -> None:
    """The flags and the model's shapes allow this tensor-parallel size (reads the file's header only)."""
    world = options.tensor_parallel_size
    if world < 1:
        raise UserError(f"--tensor-parallel-size must be at least 1 (got {world})")
    if world == 1:
        return
    if options.kv_disk_cache:
        raise UserError("--kv-disk-cache is not supported with --tensor-parallel-size > 1 (each rank holds its "
                        "own part of every KV block)")
    if options.device.startswith("cuda") or (options.device == "auto" and torch.cuda.is_available()):
        if torch.cuda.device_count() < world:
            raise UserError(f"--tensor-parallel-size {world} needs {world} GPUs; "
                            f"{torch.cuda.device_count()} are visible")
    gguf = GGUFFile(Path(path) if path else default_model_path())
    apply_overrides(gguf.metadata, options.metadata_overrides)
    check_tensor_parallel(ModelConfig.from_metadata(gguf.metadata, set(gguf.tensors)), gguf, world)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _device(options: EngineOptions) -> torch.device:
    """The ranks' device type (rank r takes GPU r): --device as resolve_device checks it."""
    return torch.device(resolve_device(options.device).type)


def _rank_main(rank: int, world: int, port: int, path: str, options: EngineOptions, conn, threads: int) -> None:
    """A rank > 0, in its own process: join, load the shard, follow rank 0's steps."""
    torch.set_num_threads(threads)
    tp = None
    try:
        tp = TensorParallelGroup.join(rank, world, port, _device(options))
        model, pool, graphs = load_rank(path, options, tp)
        follow_steps(model, pool, conn, graphs)
    except BaseException as exc:       # noqa: BLE001 -- one line, then the exit code rank 0 knows
        if not isinstance(exc, (KeyboardInterrupt, EOFError)):
            print(f"cobatch: error: tensor-parallel rank {rank}: {type(exc).__name__}: {exc}", file=sys.stderr,
                  flush=True)
        os._exit(RANK_REPORTED_EXIT)
    finally:
        if tp is not None:
            tp.leave()


class Ranks:
    """Rank 0's handle on the other ranks: their processes, the pipes to them, the watchdog."""

    def __init__(self, procs: list, link: StepLink | None = None):
        self.procs, self.link, self.stopping = procs, link, False
        self.tp: TensorParallelGroup | None = None
        threading.Thread(target=self._watch, name="cobatch-tp-watchdog", daemon=True).start()
        atexit.register(self.stop)

    def _watch(self) -> None:
        ended = multiprocessing.connection.wait([p.sentinel for p in self.procs])
        if self.stopping:
            return
        rank, proc = next((r, p) for r, p in enumerate(self.procs, start=1) if p.sentinel in ended)
        proc.join(timeout=5)            # (its sentinel closes a moment before it can be reaped)
        if proc.exitcode != RANK_REPORTED_EXIT:
            print(f"cobatch: error: tensor-parallel rank {rank} exited (code {proc.exitcode}); stopping",
                  file=sys.stderr, flush=True)
        os._exit(1)

    def stop(self) -> None:
        """Ask the ranks to stop and wait for them (rank 0 is leaving)."""
        if self.stopping:
            return
        self.stopping = True
        if self.link is not None:
            self.link.stop()
        for proc in self.procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.terminate()
        if self.tp is not None:
            self.tp.leave()


def load(path: str | Path | None = None, options: EngineOptions | None = None) -> LLM:
    """LLM.load, over options.tensor_parallel_size processes (this one is rank 0)."""
    options = options or EngineOptions()
    check(path, options)
    world = options.tensor_parallel_size
    if world == 1:
        return LLM.load(path, options)
    path = Path(path) if path else default_model_path()
    # forkserver: one clean process (no CUDA, no threads) imports torch and cobatch once, and every rank is forked
    # from it: safe as spawn, without paying the imports per rank (seconds each) or re-running the caller's __main__
    port, spawn = _free_port(), multiprocessing.get_context("forkserver")
    spawn.set_forkserver_preload(["cobatch.parallel.launch"])
    procs, conns = [], []
    for rank in range(1, world):
        parent, child = spawn.Pipe()
        proc = spawn.Process(target=_rank_main, name=f"cobatch-tp-rank{rank}", daemon=True,
                             args=(rank, world, port, str(path), options, child, torch.get_num_threads()))
        proc.start()
        child.close()
        procs.append(proc)
        conns.append(parent)
    ranks = Ranks(procs)
    try:
        ranks.tp = tp = TensorParallelGroup.join(0, world, port, _device(options))
        ranks.link = StepLink(tp, conns)
        llm = LLM.load(path, options, tp=tp, link=ranks.link)
    except BaseException:
        ranks.stopping = True          # the error is rank 0's own: the ranks waiting on it go without a word
        for proc in procs:
            proc.terminate()
        if ranks.tp is not None:
            ranks.tp.leave()
        raise
    llm.ranks = ranks
    return llm
