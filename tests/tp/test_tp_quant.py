"""Quantised models under tensor parallelism at the model level (2 gloo ranks on CPU; test_tp_model.py's tiny
checkpoints and forwards): each rank quantises its own shard while loading, and the sharded forward gives the
one-process quantised model's logits.

Tolerances (every forward's logits against ``LLM(quantization=...)`` with one process, same scheme):
- int4 (group 32) and grouped int8 (group 16, "weight_only" on every rank): the quantised weights are the
  one-process ones bit for bit (groups never straddle a shard boundary) and w4a8 quantises activations per block
  of 32 inputs, which the shards do not cut either - only the all-reduce's summation order differs: 1e-4.
- per-channel int8 ("w8a8"): each rank's scales are the max over its own columns of a row, and w8a8 quantises
  its activations per row of the rank's shard, so TP=2 is a slightly different (no worse) quantisation; measured
  0.02-1.3% of the logits' range on these models: 5% of it.
A shard quantised from the wrong columns (one group off) or a rank that drops an all-reduce's result fails both.
"""

from __future__ import annotations

import pytest
import torch
import tp_helpers as tpm

from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model, read_checkpoint_tensor
from specdec.distributed.comm import TPGroup
from specdec.distributed.launcher import TensorParallelWorkers
from specdec.distributed.worker import ModelSpec, load_shards
from specdec.model.config import ModelConfig
from specdec.model.quant.linear import QuantizedLinear

# (variant of test_tp_model.VARIANTS, quantization, group size, quantize_lm_head, tolerance)
CASES = {
    "llama-untied-kv2/int4": ("llama-untied-kv2", "int4", None, None, "exact"),
    "qwen2-tied-kv2/int4+head": ("qwen2-tied-kv2", "int4", None, True, "exact"),  # a quantised copy per vocab shard
    "qwen2-untied-kv4/int8-g16": ("qwen2-untied-kv4", "int8", 16, None, "exact"),
    "llama-tied-kv1/int8": ("llama-tied-kv1", "int8", None, None, "w8a8"),
    "qwen2-untied-kv4/int8": ("qwen2-untied-kv4", "int8", None, None, "w8a8"),
}
W8A8_TOLERANCE = 0.05  # of the largest |logit| (measured: 0.02-1.3%)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return tpm.write_variants(tmp_path_factory.mktemp("tp_quant"))


def spec_of(path: str, case: tuple) -> ModelSpec:
    _, quantization, group, head, _ = case
    return ModelSpec(path, ModelConfig.from_json(path), torch.float32, tpm.MAX_POS, tpm.BLOCKS, tpm.BLOCK_SIZE, None,
                     quantization, group, head)


@pytest.fixture(scope="module")
def workers(checkpoints):
    w = TensorParallelWorkers(2, torch.device("cpu"), 30.0, [spec_of(checkpoints[c[0]], c) for c in CASES.values()])
    yield w
    w.shutdown()


def one_process_logits(path: str, case: tuple) -> torch.Tensor:
    _, quantization, group, head, _ = case
    config = ModelConfig.from_json(path)
    model = load_model(path, torch.float32, "cpu", tpm.MAX_POS, config, quantization=quantization,
                       quantization_group_size=group, quantize_lm_head=head)
    return tpm.run_forwards(model, KVPool(config, tpm.BLOCKS, tpm.BLOCK_SIZE, torch.float32, "cpu"))


def assert_within_tolerance(got: torch.Tensor, want: torch.Tensor, kind: str) -> None:
    if kind == "exact":
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
        assert torch.equal(got.argmax(-1), want.argmax(-1))
    else:
        err, bound = (got - want).abs().max().item(), W8A8_TOLERANCE * want.abs().max().item()
        assert err <= bound, f"TP=2 differs from TP=1 by {err:.3g} > {bound:.3g}"


@pytest.mark.parametrize("name", list(CASES))
def test_quantised_shards_match_one_process(checkpoints, workers, name):
    case = CASES[name]
    model, pool = workers.shards[list(CASES).index(name)]
    layer = model.local.layers[0]
    assert isinstance(layer.mlp.down_proj, QuantizedLinear) and layer.mlp.down_proj.in_features == 64  # I / 2
    assert isinstance(model.local.lm_head, QuantizedLinear) == (case[0].find("untied") > 0 or case[3] is True)
    got = tpm.run_forwards(model, pool)
    assert_within_tolerance(got, one_process_logits(checkpoints[case[0]], case), case[4])


class _DroppedSum:
    """A planted bug on rank 0: the all-reduce still runs (the ranks stay in step) but its sum is thrown away."""

    def __init__(self, group):
        self.group = group

    def all_reduce(self, x):
        self.group.all_reduce(x.clone())
        return x


@pytest.mark.parametrize("name", ["llama-untied-kv2/int4", "qwen2-untied-kv4/int8"])
@pytest.mark.parametrize("bug", ["wrong group offset", "missing all-reduce"])
def test_planted_bugs_fail_the_comparison(checkpoints, workers, name, bug):
    case = CASES[name]
    path = checkpoints[case[0]]
    model, pool = workers.shards[list(CASES).index(name)]
    mlp = model.local.layers[1].mlp
    original = mlp.down_proj, mlp.group
    if bug == "wrong group offset":  # rank 0 quantises columns [32, 96) of down_proj instead of [0, 64)
        weight = read_checkpoint_tensor(path, "model.layers.1.mlp.down_proj.weight")  # (hidden, I)
        mlp.down_proj = QuantizedLinear.from_weight(weight[:, 32:96], None, case[1], case[2])
        mlp.down_proj.prepare(torch.device("cpu"))
    else:
        mlp.group = _DroppedSum(mlp.group)
    try:
        got = tpm.run_forwards(model, pool)
    finally:
        mlp.down_proj, mlp.group = original
    with pytest.raises(AssertionError):
        assert_within_tolerance(got, one_process_logits(path, case), case[4])
    assert_within_tolerance(tpm.run_forwards(model, pool), one_process_logits(path, case), case[4])  # restored


def _held_bytes(model) -> int:
    """Bytes of a model's weights: quantised linears by what their CPU path holds, other parameters once."""
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    inside = {id(p) for m in linears for p in m.parameters()}
    params = {id(p): p for p in model.parameters() if id(p) not in inside and not p.is_meta}
    return sum(m.held_bytes() for m in linears) + sum(p.numel() * p.element_size() for p in params.values())


@pytest.mark.parametrize("quantization", ["int4", "int8"])
def test_each_rank_holds_its_quantised_share(checkpoints, quantization):
    """Each rank's weights (loaded without a connected group: loading makes no collective) are at most the
    one-process quantised model's over 2, plus the replicated pieces - the norms and, for per-channel int8, the
    row-parallel linears' scales (one fp32 per output row on every rank) - and one padding row of the embedding
    and of the LM head (fp32 bytes: more than a quantised row)."""
    path = checkpoints["llama-untied-kv2"]  # untied: the LM head is quantised too
    config = ModelConfig.from_json(path)
    full = _held_bytes(load_model(path, torch.float32, "cpu", tpm.MAX_POS, config, quantization=quantization))
    replicated = 4 * config.hidden_size * (2 * config.num_hidden_layers + 1)  # the RMSNorm weights, fp32
    if quantization == "int8":  # o_proj's and down_proj's per-channel scales, [hidden] fp32 each
        replicated += 4 * config.hidden_size * 2 * config.num_hidden_layers
    padding = 2 * 4 * config.hidden_size * (-tpm.VOCAB % 2)
    for rank in range(2):
        group = TPGroup(rank, 2, torch.device("cpu"), 1.0)
        shard = load_model(path, torch.float32, "cpu", tpm.MAX_POS, config, quantization=quantization, group=group)
        held = _held_bytes(shard)
        print(f"\n{quantization} rank {rank}: {held} of {full} bytes (share {full // 2}, replicated {replicated})",
              end="")
        assert held <= (full - replicated) // 2 + replicated + padding
        assert isinstance(shard.layers[0].self_attn.o_proj, QuantizedLinear)


@pytest.mark.parametrize("variant", ["llama-untied-kv2", "qwen2-tied-kv2"])
def test_each_ranks_self_draft_shares_its_embedding_shard(checkpoints, variant):
    """A sharded ``draft_model="self"`` draft, loaded the way every rank loads it (``load_shards``, workers and
    rank 0 alike): its embedding is that rank's target embedding shard (and a tied head the target's head), its
    linears int4 - one copy of the embedding per rank, as with one process."""
    path = checkpoints[variant]
    config = ModelConfig.from_json(path)
    target = ModelSpec(path, config, torch.float32, tpm.MAX_POS, tpm.BLOCKS, tpm.BLOCK_SIZE, None)
    draft = ModelSpec(path, config, torch.float32, tpm.MAX_POS, tpm.BLOCKS, tpm.BLOCK_SIZE, None, "int4",
                      shares_embedding_of=0)
    for rank in range(2):
        (t, _), (d, _) = load_shards([target, draft], TPGroup(rank, 2, torch.device("cpu"), 1.0), torch.device("cpu"))
        assert d.embed_tokens.weight is t.embed_tokens.weight
        assert d.embed_tokens.weight.shape == (-(-tpm.VOCAB // 2), config.hidden_size)
        assert isinstance(d.layers[0].mlp.down_proj, QuantizedLinear)
        assert (d.lm_head is t.lm_head) == config.tie_word_embeddings
