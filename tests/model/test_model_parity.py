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
    ("qwen3", "hub", False, False),  # QK norm, no QKV bias, head_dim of its own
    ("qwen3", "v5", True, False),
    ("mistral", "hub", False, False),
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
    assert config.qkv_bias == (model_type == "qwen2") and config.qk_norm == (model_type == "qwen3")
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


def test_a_sliding_window_bounds_the_sequence_and_greedy_matches_transformers(tmp_path):
    """A Mistral checkpoint whose window (16) is shorter than its positions: max_model_len defaults to the window
    (so attending the whole context is the window's attention), a longer one is refused naming sliding_window, a
    request that would pass it is refused, and greedy decoding within it equals transformers'."""
    from helpers import small_llm

    from specdec import SamplingParams

    hf = make_tiny_model(str(tmp_path), "mistral", extra_config={"sliding_window": 16})
    assert ModelConfig.from_json(str(tmp_path)).sliding_window == 16
    llm = small_llm(str(tmp_path), dtype="float32")
    assert llm.engine.config.max_model_len == 16
    with pytest.raises(ValueError, match="sliding_window"):
        small_llm(str(tmp_path), dtype="float32", max_model_len=32)
    prompt = list(range(40, 50))
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(temperature=0, max_tokens=10))
    ours = llm.generate(prompt_token_ids=[prompt], sampling_params=SamplingParams(
        temperature=0, max_tokens=6, ignore_eos=True))[0].outputs[0].token_ids
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=6, do_sample=False)[0, len(prompt):].tolist()
    assert ours == ref


def test_qwen_sliding_window_on_some_layers_only_is_refused():
    raw = {"model_type": "qwen3", "vocab_size": 8, "hidden_size": 8, "intermediate_size": 8, "num_hidden_layers": 4,
           "num_attention_heads": 2, "rope_theta": 1e4, "use_sliding_window": True, "sliding_window": 8,
           "max_window_layers": 2}
    with pytest.raises(ValueError, match="max_window_layers=2 below num_hidden_layers=4"):
        ModelConfig.from_dict(raw)
    assert ModelConfig.from_dict({**raw, "use_sliding_window": False}).sliding_window is None
    windowed = ModelConfig.from_dict({**raw, "max_window_layers": 4, "max_position_embeddings": 64})
    assert windowed.sliding_window == 8 and windowed.position_limit == 8  # what a draft's positions are capped by


@pytest.mark.parametrize("quantization", [None, "int4"])
def test_qwen3_speculates_and_quantises_like_the_others(tmp_path, quantization):
    """Qwen3 runs the same engine paths: greedy prompt-lookup output equals plain output (float32), also with int4
    linears (the QK norms stay in float)."""
    from helpers import small_llm

    from specdec import SamplingParams, SpeculativeConfig

    make_tiny_model(str(tmp_path), "qwen3", tie_word_embeddings=True)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = [[5, 9, 12, 7] * 5, list(range(30, 45))]
    kw = dict(dtype="float32", max_model_len=128, quantization=quantization,
              quantization_group_size=16 if quantization else None)
    plain = small_llm(str(tmp_path), **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    spec = small_llm(str(tmp_path), speculative=SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=4),
                     **kw).generate(prompt_token_ids=prompts, sampling_params=params)
    assert [o.outputs[0].token_ids for o in spec] == [o.outputs[0].token_ids for o in plain]
    assert sum(o.metrics["accepted"] for o in spec) > 0
