"""``LLM(batch_invariant=True)`` on CUDA (issue 33): the invariant GEMM and attention give a row the same bits alone as
in any batch, and greedy speculative tokens equal plain greedy tokens in bf16, with CUDA graphs on.

Marked ``gpu`` (``python -m bench.gpu``'s tests step); selected without CUDA every test FAILS ("needs CUDA"). The CPU
side of the same property: tests/kernels/test_matmul_invariant.py, test_attention_invariant_plan.py (plans and the
interpreter), tests/kernels/test_cpu_invariant_*.py and tests/lossless/test_greedy_parity.py (the CPU kernels).
"""

import pytest
import torch
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams, SpeculativeConfig
from specdec.kernels.matmul_invariant import matmul_invariant
from specdec.kernels.paged_attention import paged_attention

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gemm_rows_do_not_depend_on_the_call(dtype):
    gen = torch.Generator(device="cuda").manual_seed(0)
    w = torch.randn(4096, 2048, device="cuda", generator=gen).to(dtype)
    x = torch.randn(512, 2048, device="cuda", generator=gen).to(dtype)
    full = matmul_invariant(x, w)
    for rows in (slice(0, 1), slice(7, 8), slice(3, 8), slice(0, 40), slice(100, 164)):
        assert torch.equal(matmul_invariant(x[rows], w), full[rows]), rows
    torch.testing.assert_close(full.float(), (x.float() @ w.float().T), atol=0.05 * 2048**0.5, rtol=0.02)


def test_attention_rows_do_not_depend_on_the_batch():
    gen = torch.Generator(device="cuda").manual_seed(1)
    hq, hkv, d, bs = 24, 8, 128, 16
    k = torch.randn(2048, bs, hkv, d, device="cuda", generator=gen).bfloat16()
    v = torch.randn_like(k)
    tables = torch.randperm(2048, device="cuda", generator=gen).to(torch.int32).view(64, 32)
    lens = torch.randint(40, 512, (64,), device="cuda", generator=gen).to(torch.int32)
    q_lens = [1 + (b % 5) for b in range(64)]
    cu = torch.tensor([0] + torch.tensor(q_lens).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
    q = torch.randn(sum(q_lens), hq, d, device="cuda", generator=gen).bfloat16()
    batch = paged_attention(q, k, v, tables, lens, cu, d**-0.5, invariant=True)
    start = 0
    for b in range(0, 64, 7):
        rows = slice(int(cu[b]), int(cu[b + 1]))
        alone = paged_attention(q[rows], k, v, tables[b : b + 1], lens[b : b + 1],
                                torch.tensor([0, q_lens[b]], dtype=torch.int32, device="cuda"), d**-0.5,
                                invariant=True)
        assert torch.equal(alone, batch[rows]), b
        start += q_lens[b]


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("t"))
    make_tiny_model(path, "llama", seed=1, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=512,
                    num_layers=2, lm_head_std=0.1)
    return path


@pytest.mark.parametrize("method", ["prompt_lookup", "ngram_table"])
def test_greedy_speculative_equals_plain_in_bf16(target, method):
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 257, (int(torch.randint(3, 9, (1,), generator=gen)),), generator=gen).tolist() * 4
               for _ in range(8)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)

    def run(spec, batch):
        llm = specdec.LLM(target, dtype="bfloat16", device="cuda", max_model_len=256, max_num_seqs=batch,
                          batch_invariant=True, speculative=spec)
        return [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=greedy)]

    alone = run(None, 1)
    assert run(None, 8) == alone  # a plain batch of 8 equals each request alone
    assert run(SpeculativeConfig(method=method, num_speculative_tokens=4), 8) == alone
