"""Production-shape correctness on CUDA: each compiled Triton kernel against its torch reference ON THE GPU.

Run on a CUDA machine with ``python -m pytest -m gpu tests/gpu`` (``python -m bench.gpu`` does it as its "tests"
step). The module is marked ``gpu`` (excluded from the default run by pyproject's addopts); selected on a
machine without CUDA, every test FAILS with "needs CUDA" instead of passing or skipping silently.

Shapes are the ones a served model produces: vocabularies 128256 (Llama 3) and 151936 (Qwen2.5), contexts up to
8k, batches up to 64, verification windows (k + 1 = 5 and 9 tokens) with chain and tree masks (k = 8 trees),
GQA groups 3/4/6/7 with head dims 64/128 (Llama-3.2-1B/3B, Qwen2.5-1.5B/0.5B), bf16/fp16/fp32. The references
run on the same device as the kernels (``ops.force_reference()`` or direct calls), so only the kernels differ.
"""

from __future__ import annotations

import random

import pytest
import torch

from specdec import ops
from specdec.kernels.paged_attention import paged_attention, paged_attention_reference
from specdec.kernels.softmax import softmax_with_temperature, softmax_with_temperature_reference
from specdec.kernels.spec_sample import spec_sample
from specdec.kernels.top_k_top_p import top_k_top_p_min_p, top_k_top_p_min_p_reference

pytestmark = pytest.mark.gpu
DEVICE = "cuda"  # a self-check may point this at "cpu" (interpreter) and call the tests with tiny shapes

VOCABS = [128256, 151936]
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (name, Hq, Hkv, D): GQA groups 4, 3, 7, 6 and head dims 64 / 128
HEADS = {
    "llama1b": (32, 8, 64),
    "llama3b": (24, 8, 128),
    "qwen0.5b": (14, 2, 64),
    "qwen1.5b": (12, 2, 128),
}
# (q_lens, ctx_lens, tree): decodes, long-context decodes (the split / flash-decoding path), verification
# windows, k = 8 trees, and a prefill chunk next to decodes.
ATTENTION_SHAPES = {
    "decode_b64_ctx2k": ([1] * 64, [2048] * 64, False),
    "decode_b1_ctx8k": ([1], [8192], False),
    "decode_b8_ragged_to_8k": ([1] * 8, [8192, 17, 4096, 1000, 513, 8000, 2048, 1], False),
    "verify_k4_b64_ctx1k": ([5] * 64, [1024] * 64, False),
    "verify_k4_b8_ctx8k": ([5] * 8, [8192] * 8, False),
    "tree_k8_b8_ctx4k": ([9] * 8, [4096, 9, 300, 8192, 2000, 100, 4000, 64], True),
    "tree_k8_b64_ctx512": ([9] * 64, [512] * 64, True),
    "prefill512_and_decodes": ([512, 1, 1, 5], [512, 8192, 3000, 600], False),
}
ATTENTION_TOL = {torch.bfloat16: 1.6e-2, torch.float16: 2e-3, torch.float32: 5e-3}  # fp32: tl.dot uses tf32
BLOCK_SIZE = 16


@pytest.fixture(autouse=True)
def _needs_cuda():
    """Selected without CUDA (``-m gpu`` on a CPU machine): fail loudly, never pass or skip."""
    if DEVICE == "cuda" and not torch.cuda.is_available():
        pytest.fail("needs CUDA: tests/gpu checks the compiled kernels on a GPU (run them on a CUDA machine)")


def _gen(seed: int) -> torch.Generator:
    return torch.Generator(device=DEVICE).manual_seed(seed)


# ------------------------------------------------------------------------------------------------ attention
def attention_batch(q_lens, ctx_lens, hq, hkv, d, dtype, tree, seed=0):
    """Inputs on DEVICE: every sequence's blocks scattered over a shuffled cache (random tree masks if asked)."""
    gen = _gen(seed)
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed)).tolist()
    table = torch.zeros((len(q_lens), max(blocks_per_seq)), dtype=torch.int32)
    used = 0
    for b, n in enumerate(blocks_per_seq):
        table[b, :n] = torch.tensor(perm[used : used + n], dtype=torch.int32)
        used += n
    shape = (num_blocks, BLOCK_SIZE, hkv, d)
    k_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    v_cache = torch.randn(shape, generator=gen, device=DEVICE).to(dtype)
    q = torch.randn(sum(q_lens), hq, d, generator=gen, device=DEVICE).to(dtype)
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device=DEVICE)
    args = [q, k_cache, v_cache, table.to(DEVICE), torch.tensor(ctx_lens, dtype=torch.int32, device=DEVICE), cu,
            d**-0.5]  # fmt: skip
    if tree:
        rng = random.Random(seed)
        masks = []
        for n in q_lens:
            mask = torch.eye(n, dtype=torch.bool)
            for i in range(1, n):
                parent = rng.randrange(-1, i)  # -1: another root on the context prefix
                if parent >= 0:
                    mask[i] |= mask[parent]
            masks.append(mask.flatten())
        indptr = torch.tensor([0, *torch.tensor([n * n for n in q_lens]).cumsum(0).tolist()], dtype=torch.int32)
        args += [torch.cat(masks).to(DEVICE), indptr.to(DEVICE)]
    return args


def check_attention(shape: str, heads: str, dtype: torch.dtype, shapes=ATTENTION_SHAPES) -> None:
    q_lens, ctx_lens, tree = shapes[shape]
    hq, hkv, d = HEADS[heads]
    args = attention_batch(q_lens, ctx_lens, hq, hkv, d, dtype, tree, seed=len(shape) + d)
    out = paged_attention(*args)
    with ops.force_reference():
        ref = ops.paged_attention(*args)  # the reference, on the same device
    assert out.device == ref.device == args[0].device and out.dtype == dtype
    tol = ATTENTION_TOL[dtype]
    torch.testing.assert_close(out, ref, atol=tol, rtol=tol, msg=lambda m: f"{shape} {heads} {dtype}: {m}")


@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("shape", list(ATTENTION_SHAPES))
def test_attention_bf16(shape, heads):
    check_attention(shape, heads, torch.bfloat16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("heads", ["llama1b", "llama3b"])
@pytest.mark.parametrize("shape", ["decode_b1_ctx8k", "verify_k4_b8_ctx8k", "tree_k8_b8_ctx4k",
                                   "prefill512_and_decodes"])
def test_attention_fp16_fp32(shape, heads, dtype):
    check_attention(shape, heads, dtype)


@pytest.mark.parametrize("num_splits", [1, 7, 64])
def test_attention_forced_splits_long_context(num_splits):
    """The split-KV path with an explicit split count (1 = no split), at 8k context, GQA 4."""
    args = attention_batch([1, 5, 1], [8192, 8000, 4097], 32, 8, 64, torch.bfloat16, False, seed=num_splits)
    out = paged_attention(*args, num_splits=num_splits)
    ref = paged_attention_reference(*args)
    torch.testing.assert_close(out, ref, atol=1.6e-2, rtol=1.6e-2)


# ------------------------------------------------------------------------------------------------- sampling
def sampling_settings(rows: int, seed: int):
    """Mixed per-row (temperature, top_k, top_p, min_p), greedy (t = 0) and no-op rows included."""
    gen = torch.Generator().manual_seed(seed)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3])[torch.randint(0, 4, (rows,), generator=gen)]
    top_k = torch.tensor([0, 1, 50, 1000])[torch.randint(0, 4, (rows,), generator=gen)]
    top_p = torch.tensor([1.0, 0.9, 0.5, 0.99])[torch.randint(0, 4, (rows,), generator=gen)]
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.1])[torch.randint(0, 4, (rows,), generator=gen)]
    return tuple(t.to(DEVICE) for t in (temperature, top_k, top_p, min_p))


def check_softmax(vocab: int, rows: int, dtype: torch.dtype) -> None:
    logits = (4 * torch.randn(rows, vocab, generator=_gen(vocab + rows), device=DEVICE)).to(dtype)
    temperature = sampling_settings(rows, rows)[0]
    probs, bad = softmax_with_temperature(logits, temperature)
    ref, ref_bad = softmax_with_temperature_reference(logits, temperature)
    assert not bad.any() and not ref_bad.any()
    torch.testing.assert_close(probs, ref, rtol=1e-4, atol=1e-8)
    torch.testing.assert_close(probs.sum(-1), torch.ones(rows, device=DEVICE), rtol=0, atol=1e-4)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("rows", [1, 8, 64, 320])
@pytest.mark.parametrize("vocab", VOCABS)
def test_softmax(vocab, rows, dtype):
    check_softmax(vocab, rows, dtype)


def test_softmax_flags_non_finite_rows():
    logits = torch.randn(4, VOCABS[0], generator=_gen(1), device=DEVICE)
    logits[1, 77] = float("nan")
    logits[3, -1] = float("inf")
    _, bad = softmax_with_temperature(logits, torch.ones(4, device=DEVICE))
    assert bad.tolist() == [False, True, False, True]


def check_top_k_top_p(vocab: int, rows: int) -> None:
    logits = 3 * torch.randn(rows, vocab, generator=_gen(vocab * 3 + rows), device=DEVICE)
    _, top_k, top_p, min_p = sampling_settings(rows, rows + 1)
    probs = torch.softmax(logits, dim=-1)
    out = top_k_top_p_min_p(probs, top_k, top_p, min_p)
    ref = top_k_top_p_min_p_reference(probs, top_k, top_p, min_p)
    assert torch.equal(out > 0, ref > 0), "kept sets differ"
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-8)


@pytest.mark.parametrize("rows", [1, 8, 64, 320])
@pytest.mark.parametrize("vocab", VOCABS)
def test_top_k_top_p_min_p(vocab, rows):
    check_top_k_top_p(vocab, rows)


def spec_batch(batch: int, k: int, vocab: int, seed: int, greedy_frac=0.25, onehot_frac=0.25) -> dict:
    """spec_sample inputs for ``batch`` requests of 0..k drafts, q near p, mixed greedy / one-hot / sampled rows."""
    gen = torch.Generator().manual_seed(seed)
    num_drafts = torch.randint(0, k + 1, (batch,), generator=gen)
    num_drafts[0] = k
    total = int(num_drafts.sum())
    rows = torch.arange(batch).repeat_interleave(num_drafts + 1)  # (N + B,)
    j = torch.cat([torch.arange(int(n) + 1) for n in num_drafts])
    is_draft_row = j < num_drafts[rows]
    dgen = _gen(seed)
    target_logits = 3 * torch.randn(total + batch, vocab, generator=dgen, device=DEVICE)
    draft_logits = target_logits[is_draft_row.to(DEVICE)] + 0.5 * torch.randn(total, vocab, generator=dgen,
                                                                              device=DEVICE)  # fmt: skip
    target_probs, draft_probs = torch.softmax(target_logits, -1), torch.softmax(draft_logits, -1)
    greedy = torch.rand(batch, generator=gen) < greedy_frac
    onehot = (torch.rand(batch, generator=gen) < onehot_frac) & ~greedy
    sampled = torch.multinomial(draft_probs, 1, generator=dgen).squeeze(1).cpu()
    mode = target_logits[is_draft_row.to(DEVICE)].argmax(-1).cpu()
    noise = torch.randint(0, vocab, (total,), generator=gen)
    deterministic = torch.where(torch.rand(total, generator=gen) < 0.8, mode, noise)
    draft_rows = rows[is_draft_row]
    drafts = torch.where((greedy | onehot)[draft_rows], deterministic, sampled)
    cu = torch.zeros(batch + 1, dtype=torch.int32)
    cu[1:] = num_drafts.cumsum(0)
    host = {
        "draft_token_ids": drafts, "cu_num_draft_tokens": cu, "is_greedy": greedy, "draft_is_onehot": onehot,
        "seeds": torch.randint(0, 2**62, (batch,), generator=gen),
        "positions": torch.randint(0, 1 << 20, (batch,), generator=gen),
    }  # fmt: skip
    args = {name: t.to(DEVICE) for name, t in host.items()}
    args.update(draft_probs=draft_probs, target_probs=target_probs, target_argmax=target_logits.argmax(-1),
                max_num_draft_tokens=k)  # fmt: skip
    return args


def check_spec_sample(vocab: int, batch: int, k: int) -> None:
    args = spec_batch(batch, k, vocab, seed=vocab % 1000 + batch * 10 + k)
    out, acc = spec_sample(**args)
    with ops.force_reference():
        ref_out, ref_acc = ops.spec_sample(**args)
    assert out.device == ref_out.device
    # Same Philox draws, same p(x) and q(x): identical decisions. A mismatch in a residual / bonus token can only
    # be a near-tie of argmax(r / E) where the GPU's log differs from torch's in the last bit: look at the row.
    torch.testing.assert_close(acc, ref_acc, rtol=0, atol=0)
    torch.testing.assert_close(out, ref_out, rtol=0, atol=0)
    emitted = (out != -1).sum(dim=1)
    assert torch.equal(emitted, acc.long() + 1)


@pytest.mark.parametrize("k", [1, 4, 8])
@pytest.mark.parametrize("batch", [1, 8, 64])
@pytest.mark.parametrize("vocab", VOCABS)
def test_spec_sample(vocab, batch, k):
    check_spec_sample(vocab, batch, k)


def test_ops_dispatch_on_cuda():
    """On CUDA tensors ops runs the kernel; inside force_reference() the reference, on the same device."""
    assert ops.use_triton(torch.empty(1, device=DEVICE)) == (DEVICE == "cuda")
    with ops.force_reference():
        assert not ops.use_triton(torch.empty(1, device=DEVICE))
