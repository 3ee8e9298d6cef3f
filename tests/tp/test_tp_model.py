"""Tensor parallelism at the model level (2 gloo ranks on CPU): the sharded forward against the one-process one.

One set of workers serves four tiny random fp32 checkpoints at once (one spawn for the module): Llama and Qwen2
(q/k/v bias), untied and tied embeddings, GQA with kv heads split (2 -> 1 per rank), kept whole per rank (4 -> 2)
and replicated (1 kv head on 2 ranks), and a vocabulary of 301 (an odd size: the last shard is padded). Every
forward - prefill chunks of two sequences, decodes, a tree window with a mask - must give the one-process logits.
Dropping either all-reduce, the logits gather or a slice in the loader makes them differ.
"""

from __future__ import annotations

import pytest
import torch
from tp_helpers import BLOCK_SIZE, BLOCKS, MAX_POS, VARIANTS, VOCAB, run_forwards, write_variants

from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import iter_weight_entries, load_model
from specdec.checkpoint.safetensors_reader import read_header
from specdec.distributed.comm import TPGroup
from specdec.distributed.launcher import TensorParallelWorkers
from specdec.distributed.sharding import ShardLayout, check_tensor_parallel
from specdec.distributed.worker import ModelSpec
from specdec.model.config import ModelConfig


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    return write_variants(tmp_path_factory.mktemp("tp_model"))


@pytest.fixture(scope="module")
def workers(checkpoints):
    specs = [ModelSpec(path, ModelConfig.from_json(path), torch.float32, MAX_POS, BLOCKS, BLOCK_SIZE, None)
             for path in checkpoints.values()]
    w = TensorParallelWorkers(2, torch.device("cpu"), 30.0, specs)
    yield w
    w.shutdown()
    assert all(not p.is_alive() for p in w.procs)


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_sharded_logits_match_one_process(checkpoints, workers, variant):
    path = checkpoints[variant]
    config = ModelConfig.from_json(path)
    reference = run_forwards(load_model(path, torch.float32, "cpu", MAX_POS, config),
                             KVPool(config, BLOCKS, BLOCK_SIZE, torch.float32, "cpu"))
    model, pool = workers.shards[list(VARIANTS).index(variant)]
    assert pool.k.shape[3] == max(1, config.num_key_value_heads // 2)  # this rank's kv heads only
    sharded = run_forwards(model, pool)
    assert sharded.shape == reference.shape == (17, VOCAB)
    torch.testing.assert_close(sharded, reference, rtol=1e-5, atol=1e-5)
    assert torch.equal(sharded.argmax(-1), reference.argmax(-1))


def test_each_rank_holds_its_share(checkpoints):
    """Sharded loading: each rank's parameters (loaded here without a connected group: loading needs none) are
    at most the full model's over 2 plus the replicated pieces (norms) and the vocabulary padding."""
    path = checkpoints["llama-untied-kv2"]
    config = ModelConfig.from_json(path)

    def param_bytes(model) -> int:
        return sum(p.numel() * p.element_size() for p in model.parameters())

    full = param_bytes(load_model(path, torch.float32, "cpu", MAX_POS, config, prepack_weights=False))
    replicated = 4 * config.hidden_size * (2 * config.num_hidden_layers + 1)  # the RMSNorm weights, fp32
    padding = 2 * 4 * config.hidden_size * (-VOCAB % 2)  # one zero row each of the embedding and LM head shards
    shards = []
    for rank in range(2):
        group = TPGroup(rank, 2, torch.device("cpu"), 1.0)
        shard = load_model(path, torch.float32, "cpu", MAX_POS, config, prepack_weights=False, group=group)
        shards.append(shard)
        held = param_bytes(shard)
        print(f"\nrank {rank}: {held} of {full} parameter bytes (share {full // 2}, replicated {replicated})", end="")
        assert held <= (full - replicated) // 2 + replicated + padding
    # the two shards' slices are the checkpoint's, not copies of one another
    assert not torch.equal(shards[0].layers[0].mlp.down_proj.weight, shards[1].layers[0].mlp.down_proj.weight)


def test_slices_read_from_file_match_the_tensor(checkpoints):
    """``TensorEntry.narrow``: rows and columns, straight and converting (fp32 -> bf16), with a chunk smaller
    than the tensor (several passes)."""
    entries = {e.name: e for e in read_header(next(iter(iter_weight_entries(checkpoints["qwen2-untied-kv4"])))[1].file)}
    entry = entries["model.layers.0.mlp.down_proj.weight"]  # (64, 128)
    full = entry.read()
    for dim, start, length in ((0, 5, 17), (1, 64, 64), (1, 3, 1)):
        for dtype in (torch.float32, torch.bfloat16):
            piece = entry.narrow(dim, start, length)
            out = torch.empty(piece.shape, dtype=dtype)
            piece.read_into(out, chunk_bytes=3 * 128 * 4)
            torch.testing.assert_close(out, full.narrow(dim, start, length).to(dtype), rtol=0, atol=0)
    with pytest.raises(ValueError, match="outside"):
        entry.narrow(1, 100, 29)


@pytest.mark.parametrize("heads,kv,inter,size,match", [
    (4, 2, 128, 3, "must divide num_attention_heads"),
    (6, 3, 128, 2, "key/value heads"),
    (4, 2, 130, 4, "intermediate_size"),
])
def test_unshardable_models_are_refused(heads, kv, inter, size, match):
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 300, "hidden_size": 48, "rope_theta": 1e4,
                                    "intermediate_size": inter, "num_hidden_layers": 1, "num_attention_heads": heads,
                                    "num_key_value_heads": kv})
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(config, size)


def test_layout_of_replicated_kv_heads():
    config = ModelConfig.from_dict({"model_type": "llama", "vocab_size": 10, "hidden_size": 64, "rope_theta": 1e4,
                                    "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 8,
                                    "num_key_value_heads": 2})
    layouts = [ShardLayout.of(config, r, 4) for r in range(4)]
    assert [lay.kv_head_start for lay in layouts] == [0, 0, 1, 1]  # q heads 0-3 read kv head 0, 4-7 kv head 1
    assert [lay.vocab_rows for lay in layouts] == [3, 3, 3, 1]
