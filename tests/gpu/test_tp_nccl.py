"""Tensor parallelism on NCCL (2 CUDA ranks: rank r on cuda:r): the CPU tests' checks (tests/tp/test_tp_model.py,
tests/tp/test_tp_engine.py) on the NCCL path. The sharded forward gives the one-process logits (prefill chunks of
two sequences, decodes, a tree window with a mask) for split, whole and replicated kv heads, tied and untied;
``LLM(tensor_parallel_size=2)`` gives the one-GPU engine's greedy tokens, plain and with a sharded draft.

Marked gpu; selected on a machine with fewer than 2 CUDA devices every test FAILS ("needs 2 CUDA devices"),
never skips. NOT RUN YET: no multi-GPU machine was available when they were written (docs/tensor_parallel.md).
"""

from __future__ import annotations

import pytest
import torch
from tiny_models import make_tiny_model
from tp_helpers import BLOCK_SIZE, BLOCKS, MAX_POS, VARIANTS, VOCAB, write_variants
from tp_helpers import run_forwards as cpu_run_forwards

from specdec import LLM, SamplingParams, SpeculativeConfig
from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.distributed.launcher import TensorParallelWorkers
from specdec.distributed.worker import ModelSpec
from specdec.model.config import ModelConfig

pytestmark = [pytest.mark.gpu, pytest.mark.usefixtures("no_tf32")]

CUDA = torch.device("cuda:0")
# fp32 on CUDA without TF32; the all-reduce sums the partial products in another order than one GEMM does
TOL = {"rtol": 1e-4, "atol": 1e-4}


@pytest.fixture(autouse=True)
def _needs_cuda(request):  # overrides tests/gpu/conftest.py's: this module needs two devices
    if not torch.cuda.is_available() or torch.cuda.device_count() < 2:
        n = torch.cuda.device_count() if torch.cuda.is_available() else 0
        pytest.fail(f"needs 2 CUDA devices (NCCL tensor parallelism), found {n}: {request.node.nodeid}")


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_variants(tmp_path_factory.mktemp("tp_nccl"))


@pytest.fixture(scope="module")
def workers(checkpoints):
    if torch.cuda.device_count() < 2:
        pytest.fail("needs 2 CUDA devices (NCCL tensor parallelism)")
    specs = [ModelSpec(path, ModelConfig.from_json(path), torch.float32, MAX_POS, BLOCKS, BLOCK_SIZE, None)
             for path in checkpoints.values()]
    w = TensorParallelWorkers(2, CUDA, 60.0, specs)
    assert w.group.backend == "nccl"
    yield w
    w.shutdown()
    assert all(not p.is_alive() for p in w.procs)


def run_forwards(model, pool) -> torch.Tensor:
    """tests/tp/test_tp_model.py's forwards (prefill chunks, decodes, a tree window), on cuda:0."""
    return cpu_run_forwards(model, pool, CUDA)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_nccl_sharded_logits_match_one_gpu(checkpoints, workers, variant):
    path = checkpoints[variant]
    config = ModelConfig.from_json(path)
    reference = run_forwards(load_model(path, torch.float32, CUDA, MAX_POS, config),
                             KVPool(config, BLOCKS, BLOCK_SIZE, torch.float32, CUDA))
    model, pool = workers.shards[list(VARIANTS).index(variant)]
    assert pool.k.is_cuda and pool.k.shape[3] == max(1, config.num_key_value_heads // 2)
    sharded = run_forwards(model, pool)
    assert sharded.shape == reference.shape == (17, VOCAB)
    torch.testing.assert_close(sharded, reference, **TOL)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


PROMPTS = ["hello there, the cat", "the cat sat on the mat, the cat sat on the", "in the beginning"]
GREEDY = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
OPTS = {"dtype": "float32", "device": "cuda", "max_model_len": 96, "block_size": 4, "num_kv_blocks": 96,
        "enforce_eager": True}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    root = tmp_path_factory.mktemp("tp_nccl_engine")
    target, draft = str(root / "target"), str(root / "draft")
    make_tiny_model(target, model_type="qwen2", vocab_size=VOCAB, num_heads=4, num_kv_heads=2)
    make_tiny_model(draft, model_type="qwen2", vocab_size=VOCAB, num_heads=4, num_kv_heads=2, seed=5,
                    perturb_from=target, perturb_scale=0.3)
    return target, draft


@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "sharded-draft"])
def test_nccl_engine_greedy_matches_one_gpu(pair, speculative):
    with LLM(pair[0], **OPTS) as llm:
        reference = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    spec = SpeculativeConfig(draft_model=pair[1], num_speculative_tokens=3) if speculative else None
    with LLM(pair[0], tensor_parallel_size=2, speculative=spec, **OPTS) as llm:
        assert llm.engine.workers.group.backend == "nccl"
        outs = llm.generate(PROMPTS, GREEDY)
        procs = list(llm.engine.workers.procs)
        failed = llm.engine.stats["failed_requests"]
    assert all(not p.is_alive() for p in procs), "shutdown left a worker behind"
    assert failed == 0
    assert [o.outputs[0].token_ids for o in outs] == reference
