"""The graphs' staged inputs (engine/cuda_graphs.StagedInputs): host mirror -> static device buffers; and an eager
step's metadata (runner.step_metadata).

The staging logic is device-independent, so it is checked on the CPU: what the graph reads after a step must
be that step's rows, with the bucket's padding rows harmless (slot -1, length 0), whatever earlier steps
left behind. On CUDA, tests/test_gpu_engine.py::test_graph_and_eager_agree covers the same path end to end."""

from __future__ import annotations

import torch

from cobatch.engine.cuda_graphs import STEP_ROWS, STEP_SEQS, StagedInputs, _up_to


def staged_rows(inputs: StagedInputs, bucket: int):
    return (inputs.token_ids[:bucket].tolist(), inputs.positions[:bucket].tolist(),
            inputs.slot_mapping[:bucket].tolist(), inputs.seq_lens[:bucket].tolist())


def test_fresh_inputs_write_no_kv():
    inputs = StagedInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    assert inputs.slot_mapping.tolist() == [-1] * 8 and inputs.seq_lens.tolist() == [0] * 8
    assert inputs.seq_lens.dtype == torch.int32 and inputs.block_tables.dtype == torch.int32
    assert inputs.token_ids.dtype == inputs.positions.dtype == inputs.slot_mapping.dtype == torch.int64


def test_each_step_sees_its_rows_and_harmless_padding():
    inputs = StagedInputs(max_batch=8, max_blocks=4, device=torch.device("cpu"))
    # A wide step first, so the narrower one after it must overwrite or pad every row it leaves behind.
    inputs.stage([11, 12, 13, 14, 15], [3, 40, 7, 0, 16], [3, 72, 7, 96, 48],
                 [[0], [1, 2, 4], [3], [6], [5, 7]], bucket=8)
    assert staged_rows(inputs, 8) == ([11, 12, 13, 14, 15, 0, 0, 0], [3, 40, 7, 0, 16, 0, 0, 0],
                                         [3, 72, 7, 96, 48, -1, -1, -1], [4, 41, 8, 1, 17, 0, 0, 0])
    assert inputs.block_tables[1, :3].tolist() == [1, 2, 4] and inputs.block_tables[4, :2].tolist() == [5, 7]
    inputs.stage([21, 22, 23], [41, 8, 20], [73, 8, 36], [[1, 2, 4], [9], [2, 3]], bucket=4)
    assert staged_rows(inputs, 4) == ([21, 22, 23, 0], [41, 8, 20, 0], [73, 8, 36, -1], [42, 9, 21, 0])
    # Each row's own pages are what attention reads (entries past a row's length are never read).
    assert inputs.block_tables[1, :1].tolist() == [9] and inputs.block_tables[2, :2].tolist() == [2, 3]


def test_a_prefill_step_stages_its_sequences_apart_from_its_rows():
    """The prefill graphs' inputs: rows and sequences counted apart, each sequence's first row staged, and the
    bucket's padding sequences without rows or length, after a wider step left its values behind."""
    inputs = StagedInputs(max_batch=16, max_blocks=4, device=torch.device("cpu"), max_seqs=4)
    assert inputs.query_start.tolist() == [0] * 5 and inputs.slot_mapping.tolist() == [-1] * 16
    assert inputs.prefill_work.tolist() == [-1] * 4            # 16 rows: one 64-row tile a sequence at most
    # a prompt chunk of 5 rows (positions 3..7) and two decode rows, in a bucket of 16 rows and 4 sequences
    inputs.stage_step([1, 2, 3, 4, 5, 6, 7], [3, 4, 5, 6, 7, 40, 9], [19, 20, 21, 22, 23, 72, 9], [8, 41, 10],
                      [0, 5, 6, 7], [[1, 2], [4, 5, 6], [0]], rows=16, seqs=4)
    assert inputs.token_ids[:8].tolist() == [1, 2, 3, 4, 5, 6, 7, 0]
    assert inputs.slot_mapping[:9].tolist() == [19, 20, 21, 22, 23, 72, 9, -1, -1]
    assert inputs.seq_lens.tolist() == [8, 41, 10, 0]
    assert inputs.query_start.tolist() == [0, 5, 6, 7, 7]          # the padding sequence: no rows
    assert inputs.block_tables[1, :3].tolist() == [4, 5, 6]
    # the prefill kernel's (sequence, 64-row tile) items, the most keys first: sequence 1 (41 keys), 2 (10), 0 (8)
    assert inputs.prefill_work.tolist() == [1 << 16, 2 << 16, 0, -1]
    inputs.stage_step([9, 8], [0, 1], [0, 1], [2], [0, 2], [[3]], rows=16, seqs=4)
    assert inputs.seq_lens.tolist() == [2, 0, 0, 0] and inputs.query_start.tolist() == [0, 2, 2, 2, 2]
    assert inputs.slot_mapping[:7].tolist() == [0, 1, -1, -1, -1, -1, -1]
    assert inputs.prefill_work.tolist() == [0, -1, -1, -1]


def test_step_buckets_reach_the_first_size_that_holds_the_most():
    """A 512-row chunk beside 64 decode rows (576 rows) has a bucket; so has a step of 40 sequences."""
    assert _up_to(STEP_ROWS, 576) == [16, 32, 64, 128, 256, 512, 768]
    assert _up_to(STEP_SEQS, 40) == [1, 4, 16, 64] and _up_to(STEP_SEQS, 4) == [1, 4]
    assert _up_to(STEP_ROWS, 99999) == list(STEP_ROWS)


def test_an_eager_step_with_a_chunk_gets_the_prefill_kernels_work_list():
    """runner.step_metadata, an eager step's metadata: with a chunk of several rows, the (sequence, 64-row tile)
    items of the step's tiles, the most keys first (the prefill kernels then run those programs only); a step of
    decode rows alone has none (the decode kernel runs it)."""
    from cobatch.engine.runner import step_metadata
    cpu = torch.device("cpu")
    # a 70-row chunk (positions 10..79: two tiles) and a decode row at position 40
    meta = step_metadata(list(range(71)), [0, 70, 71], [80, 41], [[0, 1, 2, 3, 4], [5, 6, 7]], cpu)
    assert meta.max_query_len == 70 and meta.prefill_work.dtype == torch.int32
    assert meta.prefill_work.tolist() == [1, 0, 1 << 16]          # sequence 0 tile 1: 80 keys, tile 0: 74, then 41
    decode = step_metadata([3, 9], [0, 1, 2], [4, 10], [[0], [1]], cpu)
    assert decode.max_query_len == 1 and decode.prefill_work is None
