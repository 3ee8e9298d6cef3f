"""Logits parity of our paged forward against transformers on tiny random configs (fp32, max abs diff <= 1e-4)."""

import pytest
import torch
from tiny_models import make_tiny_model

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.model.config import ModelConfig
from specdec.model.rope import inverse_frequencies
from specdec.runner.model_runner import ForwardItem, ModelRunner

TOL = 1e-4
CASES = [
    # (model_type, dialect, tie, rope_scaling)
    ("llama", "hub", True, True),
    ("llama", "v5", True, True),
    ("llama", "hub", False, False),
    ("qwen2", "hub", False, False),
    ("qwen2", "v5", True, False),
]


def _setup(tmp_path, model_type, dialect, tie, rope_scaling, block_size=4):
    hf = make_tiny_model(str(tmp_path), model_type, dialect=dialect, tie_word_embeddings=tie,
                         rope_scaling=rope_scaling, num_heads=4, num_kv_heads=2)
    config = ModelConfig.from_json(str(tmp_path))
    model = load_model(str(tmp_path), torch.float32, torch.device("cpu"), 256, config)
    bm = BlockManager(64, block_size)
    pool = KVPool(config, 64, block_size, torch.float32, "cpu")
    return hf, config, ModelRunner(model, pool, bm, torch.device("cpu")), bm


def _hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].float()


@pytest.mark.parametrize("model_type,dialect,tie,rope_scaling", CASES)
def test_prefill_decode_and_verify_windows_match_transformers(tmp_path, model_type, dialect, tie, rope_scaling):
    hf, config, runner, bm = _setup(tmp_path, model_type, dialect, tie, rope_scaling)
    assert config.tie_word_embeddings == tie
    assert config.qkv_bias == (model_type == "qwen2")
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (23,), generator=gen).tolist()
    ref = _hf_logits(hf, ids)  # (23, V)
    # prefill 13 tokens (not a multiple of block size 4), logits for every prompt position
    bm.allocate(0, 13)
    out = runner.forward([ForwardItem(0, ids[:13], 0, 13)])
    torch.testing.assert_close(out, ref[:13], atol=TOL, rtol=0)
    # step-by-step decode of 5 tokens
    for pos in range(13, 18):
        bm.append_slots(0, 1)
        out = runner.forward([ForwardItem(0, [ids[pos]], pos, 1)])
        torch.testing.assert_close(out[0], ref[pos], atol=TOL, rtol=0)
    # a 5-token verification window appended at once, crossing a block boundary
    bm.append_slots(0, 5)
    out = runner.forward([ForwardItem(0, ids[18:23], 18, 5)])
    torch.testing.assert_close(out, ref[18:23], atol=TOL, rtol=0)


def test_ragged_batch_of_prefill_decode_and_verify_matches_transformers(tmp_path):
    hf, config, runner, bm = _setup(tmp_path, "llama", "hub", False, True, block_size=4)
    gen = torch.Generator().manual_seed(2)
    seqs = [torch.randint(0, config.vocab_size, (n,), generator=gen).tolist() for n in (9, 14, 6)]
    # seq 0 and 1 have a cached prefix; seq 2 is a fresh prefill
    bm.allocate(0, 8)
    bm.allocate(1, 10)
    runner.forward([ForwardItem(0, seqs[0][:8], 0, 0), ForwardItem(1, seqs[1][:10], 0, 0)])
    bm.append_slots(0, 1)
    bm.append_slots(1, 4)
    bm.allocate(2, 6)
    items = [ForwardItem(0, seqs[0][8:], 8, 1), ForwardItem(1, seqs[1][10:], 10, 4), ForwardItem(2, seqs[2], 0, 6)]
    out = runner.forward(items)
    expected = torch.cat([_hf_logits(hf, seqs[0])[8:], _hf_logits(hf, seqs[1])[10:], _hf_logits(hf, seqs[2])])
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)


def test_llama3_rope_scaling_really_changes_inverse_frequencies(tmp_path):
    make_tiny_model(str(tmp_path), "llama", rope_scaling=True)
    config = ModelConfig.from_json(str(tmp_path))
    assert config.rope_scaling is not None
    scaled = inverse_frequencies(config.head_dim, config.rope_theta, config.rope_scaling)
    plain = inverse_frequencies(config.head_dim, config.rope_theta, None)
    assert not torch.allclose(scaled, plain)
    assert torch.equal(scaled[0], plain[0])  # the highest frequency is untouched by llama3 scaling
