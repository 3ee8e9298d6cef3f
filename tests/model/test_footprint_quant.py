"""A quantised engine holds its quantised weights, not a full-precision copy: the census of live tensors after
``LLM(..., quantization=...)`` is the quantised linears' bytes (their CPU paths' packed copies) + the unquantised
parameters (embedding, norms, a tied head's packed copy) + the KV pool; the mutant that keeps each linear's
fp32 rows beside its quantised copy is rejected."""

import pytest
from helpers import small_llm

from specdec.checkpoint import quant_load
from specdec.model.quant.linear import QuantizedLinear
from tests.model.test_footprint import live_tensor_bytes, make_small_model


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return make_small_model(str(tmp_path_factory.mktemp("footprint_quant")))


def census(path: str, quantization: str) -> tuple[int, int, int]:
    """(bytes the engine left alive, bytes it should hold: quantised linears + other tensors + pool, the linears'
    bytes in bf16)."""
    before = live_tensor_bytes()
    llm = small_llm(path, dtype="bfloat16", num_kv_blocks=16, block_size=16, max_model_len=128,
                      quantization=quantization)
    held = live_tensor_bytes() - before
    model = llm.engine.model
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    quantised = sum(m.held_bytes() for m in linears)
    inside = {id(p) for m in linears for p in m.parameters()}
    others = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside and not p.is_meta)
    for attr in ("packed_weight", "invariant_weight"):  # oneDNN's or the invariant GEMM's copy of a tied head
        packed_head = getattr(model.lm_head, attr, None)
        others += packed_head.nbytes if packed_head is not None else 0
    pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.pool.tensors)
    bf16_linears = sum(m.in_features * m.out_features * 2 for m in linears)
    del llm, model, linears
    return held, quantised + others + pool, bf16_linears


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_quantised_engine_holds_its_quantised_bytes(small_model, quantization):
    held, expected, bf16_linears = census(small_model, quantization)
    assert held <= 1.05 * expected, (held, expected)
    assert expected - bf16_linears < held  # sanity: the census sees the engine


def test_the_census_rejects_kept_full_precision_rows(small_model, monkeypatch):
    kept = []
    real = quant_load.QuantizedLinear.prepare

    def prepare(self, *args, **kwargs):  # the mutant: a full-precision copy of each linear stays alive
        kept.append(self.dequantize().clone())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(quant_load.QuantizedLinear, "prepare", prepare)
    held, expected, _ = census(small_model, "int8")
    assert kept and held > 1.05 * expected
