"""kernels/scratch.py: the shared per-device buffers only grow, and keep what they outgrow allocated.

Why it matters on the GPU: tests/test_gpu_engine.py loads two models in one process; the second one's load grew
the split-K and activation scratch, and the first model's decode graphs, captured on the old buffers, then wrote
partial sums into memory the allocator had given to the second model's weights.
"""

import gc
import weakref

import torch

from cobatch.kernels.scratch import DeviceScratch, SplitScratch, side_lane


def test_get_grows_and_returns_views_of_the_asked_size():
    s = DeviceScratch(torch.float16)
    a = s.get("cpu", 8)
    assert a.shape == (8,) and a.dtype == torch.float16
    b = s.get("cpu", 4)                                  # no growth: a view of the same buffer
    assert b.data_ptr() == a.data_ptr()
    c = s.get("cpu", 100)
    assert c.shape == (100,) and s.get("cpu").numel() == 100


def test_a_grown_scratch_keeps_the_buffer_it_outgrew_alive():
    s = DeviceScratch(torch.float32)
    old = weakref.ref(s.get("cpu", 16)._base)
    s.reserve("cpu", 1 << 16)
    gc.collect()
    assert old() is not None and old().numel() == 16      # graphs captured on it may still write there
    assert s.get("cpu").numel() == 1 << 16


def test_zeroed_scratch_starts_at_zero_after_growth():
    s = DeviceScratch(torch.int32, zeroed=True)
    s.get("cpu", 4).fill_(7)
    assert torch.equal(s.get("cpu", 64), torch.zeros(64, dtype=torch.int32))


def test_the_side_lane_has_split_k_buffers_of_its_own():
    """Kernels on a side stream (an MoE layer's shared experts beside its routed ones) may run at the same time as
    the step's own: their split-K partials and counters must not be the same memory."""
    SplitScratch.reserve("cpu", 64, 8)
    with side_lane():
        SplitScratch.reserve("cpu", 16, 4)
        side_partial, side_count = SplitScratch.get("cpu")
    partial, count = SplitScratch.get("cpu")
    assert not SplitScratch.on_side
    assert side_partial.data_ptr() != partial.data_ptr() and side_count.data_ptr() != count.data_ptr()
    assert side_partial.numel() >= 16 and partial.numel() >= 64
