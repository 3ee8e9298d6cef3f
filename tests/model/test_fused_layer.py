"""The decoder layer in vLLM's fused layout (the residual add carried into the next norm; rope with the K/V write;
SiLU-mul from the fused gate/up output) computes on the CPU exactly what the unfused layer computed, bit for bit in
float32 and bfloat16; with ``ops.force_triton()`` its fused kernels run (in the interpreter here) and agree with
it to rounding; without the switch the CPU never launches them."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tiny_models import make_tiny_model

from specdec import ops
from specdec.checkpoint.loader import load_model
from specdec.kernels import rms_norm, rope_kv, silu_mul
from specdec.kernels.paged_attention_reference import paged_attention_reference
from specdec.model.config import ModelConfig
from specdec.model.llama import AttentionMetadata

BLOCK_SIZE, NUM_BLOCKS = 4, 16


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("fused_layer"))
    make_tiny_model(path, "llama", seed=9, num_heads=4, num_kv_heads=2)
    return path


def _batch(config, lens=(5, 3)):
    """Two prefills over disjoint blocks: token ids, positions, metadata, all rows' logits wanted."""
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(0, config.vocab_size, (sum(lens),), generator=gen)
    positions = torch.cat([torch.arange(n) for n in lens])
    tables = torch.tensor([[1, 2], [3, 4]], dtype=torch.int32)
    rows = torch.cat([torch.full((n,), b) for b, n in enumerate(lens)])
    slots = tables[rows, positions // BLOCK_SIZE].long() * BLOCK_SIZE + positions % BLOCK_SIZE
    cu = torch.tensor([0, lens[0], sum(lens)], dtype=torch.int32)
    meta = AttentionMetadata(slots, tables, torch.tensor(lens, dtype=torch.int32), cu)
    return ids, positions, meta


def _pool(config, dtype):
    shape = (config.num_hidden_layers, NUM_BLOCKS, BLOCK_SIZE, config.num_key_value_heads, config.head_dim)
    return torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)


def _unfused_logits(model, ids, positions, pool, meta) -> torch.Tensor:
    """The forward as it was written before the fused layout: ``x = x + attn(norm(x)); x = x + mlp(norm(x))``."""
    k_caches, v_caches = pool
    x = model.embed_tokens(ids)
    for i, layer in enumerate(model.layers):
        attn = layer.self_attn
        h = layer.input_layernorm(x)
        q, k, v = attn.qkv_proj(h).split([attn.q_size, attn.kv_size, attn.kv_size], dim=-1)
        q = q.view(-1, attn.num_heads, attn.head_dim)
        k = k.view(-1, attn.num_kv_heads, attn.head_dim)
        v = v.view(-1, attn.num_kv_heads, attn.head_dim)
        q, k = model.rope(q, k, positions)
        k_caches[i].view(-1, attn.num_kv_heads, attn.head_dim)[meta.slot_mapping] = k
        v_caches[i].view(-1, attn.num_kv_heads, attn.head_dim)[meta.slot_mapping] = v
        out = paged_attention_reference(q, k_caches[i], v_caches[i], meta.block_tables, meta.seq_lens,
                                        meta.cu_q_lens, attn.scale)
        x = x + attn.o_proj(out.reshape(-1, attn.q_size))
        gate, up = layer.mlp.gate_up_proj(layer.post_attention_layernorm(x)).split(layer.mlp.intermediate_size, -1)
        x = x + layer.mlp.down_proj(F.silu(gate) * up)
    return model.logits(model.norm(x))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_layout_is_bitwise_the_unfused_forward_on_cpu(tiny_path, dtype):
    config = ModelConfig.from_json(tiny_path)
    model = load_model(tiny_path, dtype, torch.device("cpu"), 64, config, prepack_weights=False)
    ids, positions, meta = _batch(config)
    rows = torch.arange(ids.shape[0])
    pool = _pool(config, dtype)
    with torch.inference_mode():
        fused = model.forward(ids, positions, pool, meta, rows)
        expected = _unfused_logits(model, ids, positions, (pool_ref := _pool(config, dtype)), meta)
    assert torch.equal(fused, expected)
    assert torch.equal(pool[0], pool_ref[0]) and torch.equal(pool[1], pool_ref[1])


def test_forced_triton_forward_runs_the_fused_kernels_and_matches(tiny_path, monkeypatch):
    config = ModelConfig.from_json(tiny_path)
    model = load_model(tiny_path, torch.float32, torch.device("cpu"), 64, config, prepack_weights=False)
    ids, positions, meta = _batch(config)
    rows = torch.arange(ids.shape[0])
    calls = {"fused_add_rms_norm": 0, "silu_mul": 0, "rope_write_kv": 0}
    for module in (rms_norm, silu_mul, rope_kv):
        for name in calls:
            if hasattr(module, name):
                original = getattr(module, name)
                monkeypatch.setattr(module, name, lambda *a, _f=original, _n=name, **k: calls.__setitem__(
                    _n, calls[_n] + 1) or _f(*a, **k))
    with torch.inference_mode():
        reference = model.forward(ids, positions, _pool(config, torch.float32), meta, rows)
        assert calls == dict.fromkeys(calls, 0)  # the CPU path never launches a kernel
        pool = _pool(config, torch.float32)
        with ops.force_triton():
            forced = model.forward(ids, positions, pool, meta, rows)
    layers = config.num_hidden_layers
    # two norms per layer and the final one; one SiLU-mul and one rope + K/V write per layer
    assert calls == {"fused_add_rms_norm": 2 * layers + 1, "silu_mul": layers, "rope_write_kv": layers}
    torch.testing.assert_close(forced, reference, rtol=1e-4, atol=1e-4)
    before = dict(calls)
    with torch.inference_mode(), ops.force_triton(), ops.fused_forward(False):
        model.forward(ids, positions, _pool(config, torch.float32), meta, rows)
    assert calls == before  # fused_forward(False): the unfused forward, for a before/after on one GPU
