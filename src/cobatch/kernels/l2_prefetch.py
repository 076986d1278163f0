"""Weights read into the GPU's L2 cache ahead of their matmul, while the kernels before it leave memory idle.

At a few rows a step, RoPE and decode attention read a few megabytes in 10 us or so: HBM sits mostly idle while
they run. The attention output projection that follows (o, 17.8 MB in q8_0 on Llama-3-8B) is small enough for the
50 MB L2 and reaches only about a third of copy bandwidth from HBM, held by its ramp and tail. `prefetch` asks for
its bytes then, so that its GEMV finds them in L2.

One launch a weight: each thread issues one `cp.async.bulk.prefetch.L2` of a chunk of its planes (Hopper's
bulk-copy unit fetches it; nothing waits for it, nothing lands in shared memory or registers), from a table of
(address, bytes) built once per weight (`chunk_table`). The launch is a programmatic dependent that lets the next
kernel launch at once, and it waits for the kernel before only at its end, so a chain through it stays ordered.
A prefetch changes no result: the matmul reads the same bytes, from L2 or from HBM.

`UPTO_ROWS`: steps of at most this many rows prefetch (0: never; bench/plan_ab.py --switch
l2_prefetch.UPTO_ROWS=... weighs it in whole steps). There is no torch reference: on the CPU it does nothing.
"""

from __future__ import annotations

import torch

from cobatch.kernels.triton_support import gdc_launch_dependents, gdc_wait, interpreting, jit, pdl_launch, tl

UPTO_ROWS = 0
FITS_BYTES = 32 << 20    # weights larger than this are not worth a prefetch: L2 (50 MB on the H200) would not keep them
CHUNK_BYTES = 4096       # per bulk prefetch; a multiple of 16, as the instruction needs
BLOCK = 32               # chunks per program, a thread each (a multiple of 32: no lane may repeat another's)

# One bulk prefetch of $2 bytes at address $1 (16-byte aligned, $2 a multiple of 16); a lane with $2 = 0 (past the
# table's end) issues none. The output is a dummy: Triton's inline assembly needs one.
ASM_BULK_PREFETCH = """{
 .reg .pred p;
 setp.ne.u32 p, $2, 0;
 @p cp.async.bulk.prefetch.L2.global [$1], $2;
 mov.u32 $0, 0;
}"""


def chunk_table(tensors: list[torch.Tensor], chunk: int = CHUNK_BYTES) -> torch.Tensor:
    """[n, 2] int64 (address, bytes) covering every byte of `tensors` (contiguous, 16-byte aligned) in chunks
    of at most `chunk` bytes; a tensor's last chunk rounded up to 16 bytes (inside its 16-byte aligned
    allocation, so no byte beyond it is asked for that the allocator did not hand out with it)."""
    assert chunk % 16 == 0
    rows = []
    for t in tensors:
        assert t.is_contiguous() and t.data_ptr() % 16 == 0, "bulk prefetches need 16-byte aligned planes"
        base, nbytes = t.data_ptr(), t.numel() * t.element_size()
        for off in range(0, nbytes, chunk):
            size = min(chunk, nbytes - off)
            rows.append((base + off, (size + 15) // 16 * 16))
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


@jit
def _l2_prefetch_kernel(table_ptr, n_chunks, ASM: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr):
    if PDL:
        gdc_launch_dependents()        # the next kernel need not wait for the prefetches to be issued
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = i < n_chunks
    addr = tl.load(table_ptr + 2 * i, mask=live, other=0)
    size = tl.load(table_ptr + 2 * i + 1, mask=live, other=0).to(tl.int32)
    tl.inline_asm_elementwise(ASM, "=r,l,r", [addr, size], dtype=tl.int32, is_pure=False, pack=1)
    if PDL:
        gdc_wait()                     # complete only after the kernel before: the kernel after may rely on it


def wanted(n_rows: int) -> bool:
    return 0 < n_rows <= UPTO_ROWS


def prefetch(table: torch.Tensor) -> None:
    """Issue the L2 prefetches of a chunk_table (on its device)."""
    if not table.is_cuda or interpreting():
        return
    n = table.shape[0]
    _l2_prefetch_kernel[(-(-n // BLOCK),)](table, n, ASM=ASM_BULK_PREFETCH, BLOCK=BLOCK, num_warps=BLOCK // 32,
                                            **pdl_launch(table))
