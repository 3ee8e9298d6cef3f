"""Paged attention: the Triton kernel against the torch reference, and the reference against dense SDPA.

On CPU the kernel runs in the Triton interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay
small. On a CUDA machine the same cases also run on the GPU; run them with ``TRITON_INTERPRET=0`` in the
environment to test the compiled kernel there (the CPU cases are then skipped: compiled Triton needs CUDA).
"""

import random

import pytest
import torch
import torch.nn.functional as F

from specdec import ops
from specdec.kernels import paged_attention as pa
from specdec.kernels.paged_attention import paged_attention, paged_attention_reference

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
# fp16/bf16: outputs are rounded to the dtype and P is cast to it for the P @ V dot (as every fused kernel does).
TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
# fp32 dots are IEEE fp32 on GPUs too (input_precision="ieee", not tf32's ~5e-3); the compiled kernel's exp2 is
# approximate (a few ulp). Not yet run on a GPU: this bound is an estimate, far below what tf32 would need.
CUDA_FP32_TOLERANCE = 5e-5


def _tol(dtype: torch.dtype, device: str) -> dict:
    tol = TOLERANCE[dtype]
    if dtype == torch.float32 and device == "cuda" and not pa._INTERPRETED:
        tol = CUDA_FP32_TOLERANCE
    return {"atol": tol, "rtol": tol}


def _skip_unless_runnable(device: str) -> None:
    if device == "cpu" and not pa._INTERPRETED:
        pytest.skip("compiled Triton (TRITON_INTERPRET=0) cannot run on CPU tensors")


def random_tree_mask(q_len: int, gen: random.Random) -> torch.Tensor:
    """bool [q_len, q_len]: a random token tree in topological order; i sees j iff j is i or an ancestor of i."""
    mask = torch.eye(q_len, dtype=torch.bool)
    for i in range(1, q_len):
        parent = gen.randrange(-1, i)  # -1: another root, hanging off the context prefix directly
        if parent >= 0:
            mask[i] |= mask[parent]
    return mask


def make_batch(q_lens, ctx_lens, num_q_heads, num_kv_heads, head_dim, block_size, dtype, device,
               tree=False, spare_blocks=5, seed=0):  # fmt: skip
    """Random inputs: every sequence's blocks are scattered over a shuffled cache with spare blocks between."""
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(q_lens)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    max_blocks = max(blocks_per_seq) + 1  # a wider table than needed: entries past a sequence are garbage
    num_blocks = sum(blocks_per_seq) + spare_blocks
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.full((num_seqs, max_blocks), 10**6, dtype=torch.int32)  # out of range if ever read
    used = 0
    for b, n in enumerate(blocks_per_seq):
        block_tables[b, :n] = perm[used : used + n]
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    q = torch.randn(sum(q_lens), num_q_heads, head_dim, generator=gen).to(dtype)
    cu_q_lens = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_lens = torch.tensor(ctx_lens, dtype=torch.int32)
    tree_args = ()
    if tree:
        rng = random.Random(seed)
        masks = [random_tree_mask(n, rng).flatten() for n in q_lens]
        indptr = torch.tensor([0, *torch.tensor([n * n for n in q_lens]).cumsum(0).tolist()], dtype=torch.int32)
        tree_args = (torch.cat(masks), indptr)
    tensors = (q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, *tree_args)
    tensors = tuple(t.to(device) for t in tensors)
    return (*tensors[:6], head_dim**-0.5, *tensors[6:])


# (q_lens, ctx_lens, Hq, Hkv, D, block_size): ragged batches, q_len 0/1/>1 mixed, contexts crossing blocks.
CASES = {
    "decode_gqa4": ([1, 1, 1], [17, 64, 33], 8, 2, 64, 16),
    "mixed_gqa7_d128": ([1, 5, 0, 3], [40, 70, 9, 3], 14, 2, 128, 16),
    "mha_verify": ([2, 9], [9, 100], 4, 4, 64, 16),
    "gqa2_odd_block_and_head_dim": ([4, 1, 6], [23, 5, 51], 6, 3, 48, 5),
}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("case", list(CASES))
def test_kernel_matches_reference_causal(case, dtype, device):
    _skip_unless_runnable(device)
    args = make_batch(*CASES[case], dtype, device)
    out = paged_attention(*args)
    torch.testing.assert_close(out, paged_attention_reference(*args), **_tol(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_kernel_matches_reference_tree(dtype, device):
    _skip_unless_runnable(device)
    # Hq 8 / Hkv 2, D 64: trees of 1..9 tokens, one without any context prefix.
    args = make_batch([9, 1, 4, 6], [60, 20, 4, 37], 8, 2, 64, 16, dtype, device, tree=True, seed=1)
    out = paged_attention(*args)
    torch.testing.assert_close(out, paged_attention_reference(*args), **_tol(dtype, device))


@pytest.mark.parametrize("device", DEVICES)
def test_tree_mask_of_a_chain_equals_causal(device):
    _skip_unless_runnable(device)
    q_lens = [3, 7]
    args = make_batch(q_lens, [30, 7], 7, 1, 32, 8, torch.float32, device)
    chain = torch.cat([torch.ones(n, n, dtype=torch.bool).tril().flatten() for n in q_lens]).to(device)
    indptr = torch.tensor([0, 9, 58], dtype=torch.int32, device=device)
    torch.testing.assert_close(paged_attention(*args, chain, indptr), paged_attention(*args), atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
@pytest.mark.parametrize("num_splits", [2, 3, 16])
def test_split_kv_matches_reference(num_splits, tree, device):
    """Flash-decoding path: KV ranges split over programs, merged by the reduce kernel (some splits empty)."""
    _skip_unless_runnable(device)
    args = make_batch([1, 3, 1], [128, 77, 2], 4, 2, 64, 16, torch.float16, device, tree=tree, seed=2)
    out = paged_attention(*args, num_splits=num_splits)
    torch.testing.assert_close(out, paged_attention_reference(*args), **_tol(torch.float16, device))


@pytest.mark.parametrize("device", DEVICES)
def test_default_split_rule_on_a_short_batch_1_decode(device):
    """The default rule splits a batch-1 decode of a 100-token context (132 SMs assumed off CUDA; the block table
    holds 128 keys): 4 splits of one 32-key tile each (BLOCK_N shrunk from 64), merged by the reduce kernel."""
    _skip_unless_runnable(device)
    args = make_batch([1], [100], 8, 2, 64, 16, torch.float16, device, seed=4)
    plan = pa.launch_plan(*args)
    if device == "cpu":
        assert plan.grid == (1, 2, 4) and plan.constexprs["BLOCK_N"] == 32
    torch.testing.assert_close(paged_attention(*args), paged_attention_reference(*args), **_tol(torch.float16, device))


# (Hq, Hkv, D) of Llama-3.2-1B / 3B and Qwen2.5-0.5B / 1.5B
SPLIT_RULE_MODELS = [(32, 8, 64), (24, 8, 128), (14, 2, 64), (12, 2, 128)]


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
@pytest.mark.parametrize("hq,hkv,d", SPLIT_RULE_MODELS)
def test_split_rule_fills_the_sms(hq, hkv, d, dtype):
    """Decode on 132 SMs (the default off CUDA): the launcher's grid reaches one wave of CTAs with work wherever
    the context allows it (ctx // min keys per split, at most _MAX_SPLITS splits), with the fewest splits that do,
    and no split is shorter than _MIN_KEYS_PER_SPLIT keys or one BLOCK_N tile. Pure Python (meta tensors)."""
    num_sms, block_size, meta = 132, 16, torch.device("meta")
    min_keys = pa._MIN_KEYS_PER_SPLIT
    for batch in (1, 8, 64):
        for ctx in (512, 2048, 8192):
            cache = (batch * ctx // block_size, block_size, hkv, d)
            plan = pa.launch_plan(
                torch.empty(batch, hq, d, dtype=dtype, device=meta),
                torch.empty(cache, dtype=dtype, device=meta), torch.empty(cache, dtype=dtype, device=meta),
                torch.empty(batch, ctx // block_size, dtype=torch.int32, device=meta),
                torch.empty(batch, dtype=torch.int32, device=meta),
                torch.empty(batch + 1, dtype=torch.int32, device=meta), d**-0.5, interpret=False,
            )  # fmt: skip
            splits = plan.grid[2]
            busy = batch * hkv  # decode: one q tile per sequence and KV head has work (the grid's spares exit)
            where = f"batch {batch} ctx {ctx}: {busy} programs x {splits} splits"
            assert splits == pa.num_kv_splits(busy, ctx, meta, num_sms=num_sms)
            assert busy * splits >= min(num_sms, busy * min(ctx // min_keys, pa._MAX_SPLITS)), where
            if splits > 1:
                assert busy * (splits - 1) < num_sms, f"{where}: more splits than one wave needs"
                assert ctx // splits >= min_keys, f"{where}: splits under {min_keys} keys"
                assert ctx // splits >= plan.constexprs["BLOCK_N"], f"{where}: a split is less than one tile"
                assert plan.reduce_constexprs["SPLITS_PAD"] >= splits


def test_num_kv_splits_rule():
    cpu = torch.device("cpu")
    assert pa.num_kv_splits(8, 512, cpu, num_sms=132) == 16  # 17 for a wave, but 512 // 32 = 16
    assert pa.num_kv_splits(8, 8192, cpu, num_sms=132) == 17  # 136 CTAs: one wave
    assert pa.num_kv_splits(8, 8192, cpu, num_sms=108) == 14  # A100: 112 CTAs
    assert pa.num_kv_splits(2, 8192, cpu, num_sms=132) == pa._MAX_SPLITS
    assert pa.num_kv_splits(132, 8192, cpu, num_sms=132) == 1  # the programs fill the GPU already
    assert pa.num_kv_splits(0, 8192, cpu, num_sms=132) == 1
    assert pa.num_kv_splits(8, 63, cpu, num_sms=132) == 1  # under two splits' worth of keys
    assert pa.num_kv_splits(8, 100, cpu, min_keys=50, num_sms=132) == 2
    assert pa.num_kv_splits(8, 512, torch.device("meta")) == 16  # off CUDA: 132 SMs (H100) assumed
    assert pa.split_block_n(64, 512, 16) == 32 and pa.split_block_n(64, 512, 4) == 64
    assert pa.split_block_n(64, 144, 16) == 32 and pa.split_block_n(16, 512, 16) == 16  # never below 32 / above
    assert pa.split_block_n(64, 48, 1) == 64


@pytest.mark.parametrize("device", DEVICES)
def test_empty_batch_and_zero_q_len(device):
    _skip_unless_runnable(device)
    args = make_batch([0, 2, 0], [5, 9, 1], 4, 2, 16, 4, torch.float32, device)
    torch.testing.assert_close(paged_attention(*args), paged_attention_reference(*args), atol=1e-5, rtol=1e-5)
    args = make_batch([0, 0], [5, 9], 4, 2, 16, 4, torch.float32, device)
    assert paged_attention(*args).shape == (0, 4, 16)
    q, k, v, _, _, _, scale = args
    no_seqs = (torch.zeros(0, 3, dtype=torch.int32, device=device), torch.zeros(0, dtype=torch.int32, device=device),
               torch.zeros(1, dtype=torch.int32, device=device))  # fmt: skip
    assert paged_attention(q, k, v, *no_seqs, scale).shape == (0, 4, 16)


@pytest.mark.parametrize("device", DEVICES)
def test_non_contiguous_cache_and_query(device):
    """Strided inputs: K and V interleaved in one [num_blocks, 2, ...] tensor; q sliced out of a fused qkv."""
    _skip_unless_runnable(device)
    q, k, v, bt, sl, cu, scale = make_batch([2, 1], [19, 40], 4, 2, 32, 8, torch.float16, device)
    kv = torch.stack([k, v], dim=1)  # (num_blocks, 2, block_size, Hkv, D)
    qkv = torch.cat([q, torch.zeros_like(q)], dim=1)  # (T, 2 * Hq, D)
    args = (qkv[:, :4], kv[:, 0], kv[:, 1], bt, sl, cu, scale)
    assert not args[0].is_contiguous() and not args[1].is_contiguous()
    torch.testing.assert_close(paged_attention(*args), paged_attention_reference(*args), **_tol(torch.float16, device))


@pytest.mark.parametrize("device", DEVICES)
def test_block_offsets_beyond_int32(device):
    """Block ids whose element offset (id * block stride) exceeds 2**31: the kernel must use 64-bit offsets.

    K and V are interleaved in one fp16 [2**22 + 8, 2, 16, 1, 16] tensor (block stride 2**9 elements): 4 GiB of
    address space that is never touched except for the few blocks written here, so it costs almost no memory.
    """
    _skip_unless_runnable(device)
    num_blocks, block_size = 2**22 + 8, 16
    if device == "cuda" and torch.cuda.mem_get_info()[0] < 6 * 2**30:
        pytest.skip("needs 4 GiB of free GPU memory")
    kv = torch.empty((num_blocks, 2, block_size, 1, 16), dtype=torch.float16, device=device)
    ids = torch.tensor([[num_blocks - 1, 3, 2**22 + 1], [7, 2**22, 0]], dtype=torch.int32, device=device)
    assert int(ids.max()) * kv.stride(0) >= 2**31
    gen = torch.Generator().manual_seed(3)
    kv[ids.flatten().long()] = torch.randn(6, 2, block_size, 1, 16, generator=gen).to(device, torch.float16)
    q = torch.randn(3, 2, 16, generator=gen).to(device, torch.float16)
    seq_lens = torch.tensor([40, 35], dtype=torch.int32, device=device)
    cu_q_lens = torch.tensor([0, 1, 3], dtype=torch.int32, device=device)
    args = (q, kv[:, 0], kv[:, 1], ids, seq_lens, cu_q_lens, 0.25)
    torch.testing.assert_close(paged_attention(*args), paged_attention_reference(*args), **_tol(torch.float16, device))


def test_ops_dispatch_runs_the_kernel_when_forced():
    args = make_batch([1, 2], [10, 20], 4, 2, 16, 4, torch.float32, "cpu")
    with ops.force_triton():
        out = ops.paged_attention(*args)
    torch.testing.assert_close(out, paged_attention_reference(*args), atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------------------------------- the oracle itself


def dense_attention(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale, tree_mask=None, indptr=None):
    """Non-paged SDPA per sequence with an explicit boolean mask: an independent check of the reference."""
    out = torch.empty_like(q, dtype=torch.float32)
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = q.shape[1] // num_kv_heads
    for b in range(len(seq_lens)):
        start, end, ctx = int(cu_q_lens[b]), int(cu_q_lens[b + 1]), int(seq_lens[b])
        n = end - start
        if n == 0:
            continue
        slots = [int(block_tables[b, p // block_size]) * block_size + p % block_size for p in range(ctx)]
        flat = (-1, num_kv_heads, k_cache.shape[3])
        keys = k_cache.reshape(flat)[slots].float().transpose(0, 1)  # (Hkv, ctx, D)
        values = v_cache.reshape(flat)[slots].float().transpose(0, 1)  # (Hkv, ctx, D)
        allowed = torch.zeros(n, ctx, dtype=torch.bool)  # (q_len, ctx)
        for i in range(n):
            pos = ctx - n + i  # absolute position of new token i
            allowed[i, : ctx - n] = True
            for j in range(n):
                sees = bool(tree_mask[int(indptr[b]) + i * n + j]) if tree_mask is not None else j <= i
                allowed[i, ctx - n + j] = sees
            assert allowed[i, pos] or tree_mask is not None
        qb = q[start:end].float().transpose(0, 1)  # (Hq, q_len, D)
        o = F.scaled_dot_product_attention(
            qb, keys.repeat_interleave(group, 0), values.repeat_interleave(group, 0), attn_mask=allowed, scale=scale
        )  # (Hq, q_len, D)
        out[start:end] = o.transpose(0, 1)
    return out.to(q.dtype)


# Beyond CASES: sequences longer than WINDOW_BATCH_MAX_Q new tokens (attended one by one, the prefill path)
# next to padded windows, and a batch of windows only with ragged lengths.
REFERENCE_CASES = {
    "prefill_next_to_windows": ([20, 1, 0, 5, 17], [20, 30, 7, 40, 50], 6, 2, 32, 8),
    "ragged_windows": ([16, 2, 9, 1], [16, 3, 60, 1], 4, 1, 16, 4),
}


@pytest.mark.parametrize("tree", [False, True], ids=["causal", "tree"])
def test_reference_matches_dense_sdpa(tree):
    for seed, case in enumerate([*CASES.values(), *REFERENCE_CASES.values()]):
        args = make_batch(*case, torch.float32, "cpu", tree=tree, seed=seed)
        torch.testing.assert_close(paged_attention_reference(*args), dense_attention(*args), atol=1e-5, rtol=1e-5)


def test_reference_plan_is_rebuilt_when_metadata_changes_in_place():
    """The per-forward plan is memoised on the metadata tensors; an in-place edit must invalidate it."""
    args = list(make_batch([3, 1], [10, 12], 4, 2, 16, 4, torch.float32, "cpu"))
    first = paged_attention_reference(*args)
    args[4][1] = 9  # seq_lens, in place: sequence 1 now sees 9 positions
    torch.testing.assert_close(paged_attention_reference(*args), dense_attention(*args), atol=1e-5, rtol=1e-5)
    assert not torch.allclose(paged_attention_reference(*args)[3], first[3])


# ------------------------------------------------------------------------------------------- validation


def _valid_args():
    return list(make_batch([1, 2], [5, 9], 4, 2, 16, 4, torch.float16, "cpu"))


def _with(index, value):
    args = _valid_args()
    args[index] = value(args[index]) if callable(value) else value
    return args


INVALID = {
    "q must be fp32/fp16/bf16": _with(0, lambda q: q.to(torch.float64)),
    "dtypes .* must equal q's": _with(1, lambda k: k.float()),
    r"q must be \[T, Hq, D\]": _with(0, lambda q: q[None]),
    "v_cache shape": _with(2, lambda v: v[:, :2]),
    "head_dim of q": _with(0, lambda q: q[..., :8]),
    "positive multiple of Hkv": _with(0, lambda q: q[:, :3]),
    "contiguous in its last": _with(0, lambda q: q.transpose(1, 2).contiguous().transpose(1, 2)),
    "block_tables must be int32": _with(3, lambda t: t.long()),
    "seq_lens must be int32": _with(4, lambda t: t.long()),
    "cu_q_lens must have B \\+ 1": _with(5, lambda t: t[:-1]),
    "block_tables has 1 rows": _with(3, lambda t: t[:1]),
    "the batch has no sequence": [*_valid_args()[:3], torch.zeros(0, 3, dtype=torch.int32),
                                  torch.zeros(0, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), 1.0],
    "cu_q_lens must rise from 0 to T": _with(5, lambda t: t - 1),
    "q_len <= seq_len": _with(4, lambda t: torch.tensor([5, 1], dtype=torch.int32)),
    "max_blocks \\* block_size": _with(4, lambda t: torch.tensor([5, 99], dtype=torch.int32)),
    "ids outside": _with(3, lambda t: t + 100),
    "scale must be finite": _with(6, float("nan")),
    "must be given together": [*_valid_args(), torch.zeros(5, dtype=torch.bool)],
    "tree_mask must be a contiguous 1-d": [*_valid_args(), torch.zeros(5, dtype=torch.int32),
                                           torch.tensor([0, 1, 5], dtype=torch.int32)],
    "must lie within tree_mask": [*_valid_args(), torch.zeros(4, dtype=torch.bool),
                                  torch.tensor([0, 1, 5], dtype=torch.int32)],
    "is on meta but q is on cpu": _with(1, lambda k: k.to("meta")),
}


@pytest.mark.parametrize("message", list(INVALID))
def test_launcher_rejects_bad_inputs(message):
    with pytest.raises(ValueError, match=message):
        paged_attention(*INVALID[message])


def test_launcher_rejects_non_tensors_and_bad_splits():
    args = _valid_args()
    with pytest.raises(TypeError, match="seq_lens must be a torch.Tensor"):
        paged_attention(*args[:4], [5, 9], *args[5:])
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(*args, num_splits=0)


def test_reference_batched_decode_path_equals_per_sequence_calls():
    """The reference's padded one-call path for a batch agrees with one call per sequence."""
    gen = torch.Generator().manual_seed(5)
    num_blocks, block_size, hkv, group, dim = 40, 4, 2, 3, 16
    k_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, hkv, dim, generator=gen)
    seq_lens = torch.tensor([1, 9, 4, 13], dtype=torch.int32)
    tables = torch.randperm(num_blocks, generator=gen)[:16].view(4, 4).to(torch.int32)
    tables[0, 1:] = 10**6  # junk past a sequence's end is never read
    q = torch.randn(4, hkv * group, dim, generator=gen)
    batched = paged_attention_reference(q, k_cache, v_cache, tables, seq_lens, torch.arange(5, dtype=torch.int32), 0.3)
    for b in range(4):
        single = paged_attention_reference(q[b : b + 1], k_cache, v_cache, tables[b : b + 1], seq_lens[b : b + 1],
                                           torch.tensor([0, 1], dtype=torch.int32), 0.3)
        torch.testing.assert_close(batched[b : b + 1], single)
