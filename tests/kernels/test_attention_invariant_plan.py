"""The Triton paged attention's invariant launch (``paged_attention(invariant=True)``, ``LLM(batch_invariant=True)`` on
CUDA; issue 33) without a GPU: its plan - tile configuration, warps, stages, KV splits - is the same for a decode, a
window, a prefill chunk and any batch (only the grid's q-tile count changes), where the default plan's splits and
tiles change with them; in the interpreter a row's output is the same bits alone as in a batch."""

from __future__ import annotations

import pytest
import torch

from specdec.kernels.paged_attention import launch_plan, paged_attention

META = torch.device("meta")
HQ, HKV, D, BLOCK = 8, 2, 64, 16


def plan(batch, q_len, width, invariant, dtype=torch.bfloat16):
    q = torch.empty(batch * q_len, HQ, D, dtype=dtype, device=META)
    cache = torch.empty(4096, BLOCK, HKV, D, dtype=dtype, device=META)
    tables = torch.empty(batch, width, dtype=torch.int32, device=META)
    lens = torch.empty(batch, dtype=torch.int32, device=META)
    cu = torch.empty(batch + 1, dtype=torch.int32, device=META)
    return launch_plan(q, cache, cache, tables, lens, cu, D**-0.5, interpret=False, invariant=invariant)


SHAPES = [(1, 1, 8), (1, 1, 256), (1, 5, 64), (8, 5, 64), (64, 1, 128), (1, 512, 64), (3, 40, 32)]


def test_the_invariant_plan_does_not_depend_on_the_batch():
    plans = [plan(*shape, invariant=True) for shape in SHAPES]
    for p in plans:
        assert p.constexprs == plans[0].constexprs
        assert (p.num_warps, p.num_stages, p.grid[1:], p.reduce_grid) == (plans[0].num_warps, plans[0].num_stages,
                                                                            (HKV, 1), None)
    default = [plan(*shape, invariant=False) for shape in SHAPES]  # the mutant: the default plan does change
    assert len({(p.grid[2], tuple(sorted(p.constexprs.items()))) for p in default}) > 1
    with pytest.raises(ValueError, match="no KV split"):
        q = torch.empty(1, HQ, D, device=META)
        cache = torch.empty(8, BLOCK, HKV, D, device=META)
        launch_plan(q, cache, cache, torch.empty(1, 2, dtype=torch.int32, device=META),
                    torch.empty(1, dtype=torch.int32, device=META), torch.empty(2, dtype=torch.int32, device=META),
                    1.0, interpret=False, invariant=True, num_splits=4)


def test_in_the_interpreter_a_row_is_the_same_alone_and_in_a_batch():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(32, BLOCK, HKV, D, generator=gen).half()
    v = torch.randn(32, BLOCK, HKV, D, generator=gen).half()
    tables = torch.randperm(32, generator=gen).to(torch.int32).view(4, 8)
    lens, q_lens = [100, 37, 128, 6], [1, 5, 20, 6]
    q = torch.randn(sum(q_lens), HQ, D, generator=gen).half()
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32)
    batch = paged_attention(q, k, v, tables, torch.tensor(lens, dtype=torch.int32), cu, D**-0.5, invariant=True)
    start = 0
    for b, (n, ql) in enumerate(zip(lens, q_lens)):
        alone = paged_attention(q[start : start + ql], k, v, tables[b : b + 1], torch.tensor([n], dtype=torch.int32),
                                torch.tensor([0, ql], dtype=torch.int32), D**-0.5, invariant=True)
        assert torch.equal(alone, batch[start : start + ql]), b
        start += ql
