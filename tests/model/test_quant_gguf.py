"""GGUF Q4_0 / Q4_1 / Q8_0 linears kept quantised: read straight into our int4 / int8 formats (group 32), they
dequantise to exactly what ``gguf``'s own dequantisation gives (the converted folder holds that, un-permuted for
llama); other types, or another group size, are quantised again from the dequantised values. With
``quantization="gguf"`` every linear is held in its file's format (Q4_K / Q6_K / Q5_0 too), or dense where none of ours
fits. Tiny GGUF files are written here with ``gguf``'s writer (random valid blocks for the K-quants, which ``gguf``
cannot quantise); the default model's file (SmolLM2, Q4_1) is checked too where installed."""

from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

import test_gguf as tg  # noqa: E402  (tests/model is on sys.path: its helpers write tiny GGUF files)

from specdec.checkpoint.gguf import convert_gguf  # noqa: E402
from specdec.checkpoint.gguf_blocks import read_blocks  # noqa: E402
from specdec.checkpoint.loader import iter_weight_entries, iter_weights  # noqa: E402
from specdec.checkpoint.quant_load import load_quantized  # noqa: E402
from specdec.model.config import ModelConfig  # noqa: E402
from specdec.model.llama import LlamaForCausalLM  # noqa: E402
from specdec.model.quant.formats import dequantize  # noqa: E402
from specdec.model.quant.linear import QuantizedLinear  # noqa: E402

LINEAR_SUFFIXES = ("_proj.weight", "lm_head.weight")


def write_quantised_gguf(path, arch: str, qtype_name: str, monkeypatch) -> None:
    """``test_gguf.write_tiny_gguf``'s model (hidden 64, ffn 64: widths divisible by 32) with every linear weight
    stored as ``qtype_name`` (gguf's own quantiser), the rest F32."""
    monkeypatch.setitem(tg._TINY, "hidden", 64)
    monkeypatch.setitem(tg._TINY, "ffn", 64)
    qtype = gguf.GGMLQuantizationType[qtype_name]
    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, *args, **kwargs):
        if name.endswith(".weight") and array.ndim == 2 and not name.startswith("token_embd"):
            data = gguf.quants.quantize(array.astype(np.float32), qtype)
            return real_add(self, name, data, *args, raw_dtype=qtype, **kwargs)  # shape from the bytes
        return real_add(self, name, array, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    tg.write_tiny_gguf(path, arch=arch, pre="qwen2" if arch == "qwen2" else "smollm")
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", real_add)


def _load(folder, gguf_path, quantization, group=32, tp_group=None):
    config = ModelConfig.from_json(folder)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=64, group=tp_group)
    counts = load_quantized(model, iter_weight_entries(folder), quantization, group, torch.device("cpu"),
                            torch.float32, cpu_path="weight_only", gguf_path=gguf_path)
    return model, counts


def _fused_reference(folder, model) -> dict[str, torch.Tensor]:
    """Module name -> the converted folder's fp32 weight (gguf's dequantisation), q/k/v and gate/up fused; ``model``'s
    tensor-parallel shard of it when it is one."""
    parts: dict[str, dict[int, torch.Tensor]] = {}
    for hf_name, tensor in iter_weights(folder):
        name = hf_name.removeprefix("model.")
        if not name.endswith(LINEAR_SUFFIXES):
            continue
        tensor = model.layout.slice_of(hf_name, tensor)
        module, shard = name.rsplit(".", 1)[0], 0
        for fragment, (fused, index) in model._FUSED.items():
            if f".{fragment}." in name:
                module, shard = name.replace(fragment, fused).rsplit(".", 1)[0], index
        parts.setdefault(module, {})[shard] = tensor.float()
    return {m: torch.cat([p[i] for i in sorted(p)]) for m, p in parts.items()}


@pytest.mark.parametrize("qtype,scheme", [("Q4_0", "int4"), ("Q4_1", "int4"), ("Q8_0", "int8")])
@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_kept_blocks_dequantise_exactly_like_gguf(tmp_path, monkeypatch, qtype, scheme, arch):
    path = tmp_path / "tiny.gguf"
    write_quantised_gguf(path, arch, qtype, monkeypatch)
    for t in gguf.GGUFReader(path).tensors:  # the block reader alone, against gguf on the raw tensors
        if t.tensor_type.name == qtype:
            q, s, o = read_blocks(t)
            expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            assert torch.equal(dequantize(q, s, o, 8 if o is None else 4), torch.from_numpy(expected)), t.name
    folder = convert_gguf(path, tmp_path / "hf")
    model, counts = _load(folder, str(path), scheme)
    reference = _fused_reference(folder, model)
    linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
    assert counts == {"kept": len(linears), "quantized": 0} and set(linears) == set(reference)
    for name, module in linears.items():
        assert module.group_size == 32
        assert torch.equal(module.dequantize(), reference[name]), name  # un-permuted rows included (llama)


@pytest.mark.parametrize("qtype,scheme,arch", [("Q4_1", "int4", "qwen2"), ("Q8_0", "int8", "llama")])
def test_kept_blocks_are_sliced_per_tensor_parallel_rank(tmp_path, monkeypatch, qtype, scheme, arch):
    """Under tensor parallelism each rank keeps its slice of the GGUF blocks (rows, or whole 32-wide blocks of
    columns for o_proj / down_proj): it dequantises exactly to that rank's slice of the converted folder."""
    from specdec.distributed.comm import TPGroup

    path = tmp_path / "tiny.gguf"
    write_quantised_gguf(path, arch, qtype, monkeypatch)
    folder = convert_gguf(path, tmp_path / "hf")
    for rank in range(2):
        model, counts = _load(folder, str(path), scheme, tp_group=TPGroup(rank, 2, torch.device("cpu"), 1.0))
        reference = _fused_reference(folder, model)
        linears = {n: m for n, m in model.named_modules() if isinstance(m, QuantizedLinear)}
        assert counts == {"kept": len(linears), "quantized": 0} and set(linears) == set(reference)
        assert model.layers[0].mlp.down_proj.in_features == 32  # ffn 64 over 2 ranks
        for name, module in linears.items():
            w = module.dequantize()
            rows = reference[name].shape[0]  # the LM head's last shard has a zero padding row
            assert torch.equal(w[:rows], reference[name]) and not w[rows:].any(), (rank, name)


@pytest.mark.parametrize("qtype,scheme,group", [("Q8_0", "int4", 32), ("Q4_1", "int8", None), ("Q4_0", "int4", 64)])
def test_other_mappings_are_requantised(tmp_path, monkeypatch, qtype, scheme, group):
    path = tmp_path / "tiny.gguf"
    write_quantised_gguf(path, "qwen2", qtype, monkeypatch)
    folder = convert_gguf(path, tmp_path / "hf")
    model, counts = _load(folder, str(path), scheme, group)
    assert counts["kept"] == 0 and counts["quantized"] > 0


def test_default_model_keeps_its_q4_1_linears():
    from specdec.checkpoint.default_model import default_gguf_path, default_model_path

    try:
        gguf_path = str(default_gguf_path())
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))
    folder = default_model_path()
    reader = gguf.GGUFReader(gguf_path)
    blk0 = {t.name: t for t in reader.tensors if t.name.startswith("blk.0.")}
    model, counts = _load(folder, gguf_path, "int4")
    assert counts == {"kept": 4 * model.config.num_hidden_layers, "quantized": 0}
    down = model.layers[0].mlp.down_proj.dequantize()
    t = blk0["blk.0.ffn_down.weight"]
    expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
    assert torch.equal(down, torch.from_numpy(expected))


# --- quantization="gguf": every linear in the format its file stores it in -------------------------------------

_K_TYPES = {  # tensor -> GGUF type, as Q4_K_M / Q5_K_M files mix them (layer 1: Q5_K, Q5_1; the head: Q2_K, dense)
    "attn_q": "Q4_K", "attn_k": "Q4_K", "attn_v": "Q6_K", "attn_output": "Q5_0",
    "ffn_gate": "Q4_K", "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q2_K",
}
_LAYER1_TYPES = {"blk.1.ffn_down.weight": "Q5_K", "blk.1.attn_output.weight": "Q5_1"}
# block bytes, then (offset, scale) of each fp16 field: random bytes elsewhere are valid blocks
_BLOCKS = {"Q4_K": (144, [(0, 2e-4), (2, 2e-4)]), "Q6_K": (210, [(208, 5e-5)]), "Q5_0": (22, [(0, 1e-2)]),
           "Q8_0": (34, [(0, 1e-3)]), "Q5_K": (176, [(0, 1e-4), (2, 1e-4)]), "Q5_1": (24, [(0, 1e-2), (2, -0.15)]),
           "Q2_K": (84, [(80, 2e-3), (82, 2e-3)])}


def _random_blocks(n: int, k: int, qtype: str, rng: np.random.Generator) -> np.ndarray:
    """uint8 ``[n, bytes per row]``: random valid ``qtype`` blocks (finite fp16 scales of a sensible size)."""
    size, fields = _BLOCKS[qtype]
    elems = gguf.constants.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[qtype]][0]
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for at, scale in fields:
        raw[..., at : at + 2] = (rng.random((n, k // elems, 1)) * scale + scale / 4).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def write_k_quant_gguf(path, arch: str, monkeypatch) -> None:
    """``test_gguf.write_tiny_gguf``'s model widened to 256 (a K-quant super-block) with its linears stored as
    ``_K_TYPES`` says: q/k Q4_K beside v Q6_K and gate Q4_K beside up Q8_0 (fused linears of mixed formats)."""
    monkeypatch.setitem(tg._TINY, "hidden", 256)
    monkeypatch.setitem(tg._TINY, "ffn", 256)
    rng = np.random.default_rng(0)
    real_add = gguf.GGUFWriter.add_tensor

    def add_tensor(self, name, array, *args, **kwargs):
        kind = name.removesuffix(".weight").split(".")[-1]
        if name.endswith(".weight") and array.ndim == 2 and kind in _K_TYPES:
            qtype = _LAYER1_TYPES.get(name, _K_TYPES[kind])
            data = _random_blocks(*array.shape, qtype, rng)
            return real_add(self, name, data, *args, raw_dtype=gguf.GGMLQuantizationType[qtype], **kwargs)
        return real_add(self, name, array, *args, **kwargs)

    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", add_tensor)
    tg.write_tiny_gguf(path, arch=arch, pre="qwen2" if arch == "qwen2" else "smollm")
    monkeypatch.setattr(gguf.GGUFWriter, "add_tensor", real_add)


@pytest.mark.parametrize("arch", ["qwen2", "llama"])
def test_gguf_mode_runs_the_files_own_weights(tmp_path, monkeypatch, arch):
    """Q4_K / Q6_K / Q5_0 / Q5_1 / Q5_K / Q8_0 linears are held as stored (exactly gguf's dequantisation, Q/K
    un-permuted for llama; fused q/k/v and gate/up of mixed formats as a ``RowStack``); a Q2_K head, which maps onto
    none of our formats, stays dense with the converted values - nothing is quantised again."""
    from specdec.model.linear import Linear
    from specdec.model.quant.linear import RowStack

    path = tmp_path / "tiny.gguf"
    write_k_quant_gguf(path, arch, monkeypatch)
    for t in gguf.GGUFReader(path).tensors:
        if t.tensor_type.name in ("Q4_K", "Q6_K", "Q5_0", "Q5_1", "Q5_K"):
            q, s, o = read_blocks(t)
            expected = gguf.quants.dequantize(t.data, t.tensor_type).reshape(tuple(int(n) for n in reversed(t.shape)))
            bits = 8 if q.dtype == torch.int8 else 4
            assert torch.equal(dequantize(q, s, o, bits), torch.from_numpy(expected)), t.name
    folder = convert_gguf(path, tmp_path / "hf")
    model, counts = _load(folder, str(path), "gguf", group=None)
    reference = _fused_reference(folder, model)
    dense = {"lm_head"} if arch == "qwen2" else set()  # llama: the head is the (dense) embedding
    assert counts == {"kept": len(reference) - len(dense), "quantized": 0, "dense": len(dense)}
    for name, module in model.named_modules():
        if name not in reference:
            continue
        if name in dense:
            assert type(module) is Linear and torch.equal(module.weight, reference[name]), name
            continue
        assert isinstance(module, RowStack) == name.endswith(("qkv_proj", "gate_up_proj")), name
        parts = module.parts if isinstance(module, RowStack) else [module]
        assert torch.equal(torch.cat([p.dequantize() for p in parts]), reference[name]), name
    groups = {p.group_size for m in model.modules() if isinstance(m, RowStack) for p in m.parts}
    assert groups == {16, 32}
    with_offsets = model.layers[1].mlp.down_proj, model.layers[1].self_attn.o_proj  # Q5_K, Q5_1: int8 + offsets
    assert all(m.bits == 8 and m.offset is not None and m.group_size == 32 for m in with_offsets)


def test_gguf_mode_speculates_exactly_in_bf16(tmp_path, monkeypatch):
    """With the file's blocks on the native paths (w4a8 with fp32 scales, w8g) in bf16, greedy prompt lookup and
    n-gram drafting give plain greedy decoding's tokens: every kept format is row-invariant."""
    from helpers import small_llm

    from specdec import SamplingParams, SpeculativeConfig
    from specdec.model.quant import native

    if not native.available():
        pytest.skip("no AVX-512 VNNI or no C compiler here: the kept formats run weight_only")
    path = tmp_path / "tiny.gguf"
    write_k_quant_gguf(path, "qwen2", monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    prompts = ["hello world hello world hello", "the cat the cat the dog"]
    plain = small_llm(str(path), dtype="bfloat16", max_model_len=128, quantization="gguf")
    paths = {getattr(m, "path", None) for m in plain.engine.model.modules()}
    assert {"w4a8", "w8g"} <= paths
    expected = [o.outputs[0].token_ids for o in plain.generate(prompts, params)]
    for method in ("prompt_lookup", "ngram_table"):
        spec = small_llm(str(path), dtype="bfloat16", max_model_len=128, quantization="gguf",
                         speculative=SpeculativeConfig(method=method, num_speculative_tokens=3))
        assert [o.outputs[0].token_ids for o in spec.generate(prompts, params)] == expected, method


def test_gguf_mode_is_refused_without_a_gguf(tmp_path):
    from helpers import small_llm
    from tiny_models import make_tiny_model

    make_tiny_model(str(tmp_path / "m"))
    with pytest.raises(ValueError, match="pass a .gguf model"):
        small_llm(str(tmp_path / "m"), quantization="gguf")


def test_gguf_mode_is_refused_under_tensor_parallelism():
    from specdec.distributed.sharding import check_quantized_tensor_parallel

    config = ModelConfig.from_dict({"model_type": "qwen2", "hidden_size": 256, "intermediate_size": 256,
                                    "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 1,
                                    "vocab_size": 64, "rope_theta": 1e6, "rms_norm_eps": 1e-6})
    check_quantized_tensor_parallel(config, 1, "gguf", None)  # one process: fine
    with pytest.raises(ValueError, match="runs on one process"):
        check_quantized_tensor_parallel(config, 2, "gguf", None)


def test_a_gguf_draft_runs_its_own_blocks(tmp_path, monkeypatch):
    """``draft_quantization="gguf"``: a separate .gguf draft keeps its blocks too; greedy speculation with it equals
    plain greedy decoding of the gguf-mode target in bf16."""
    from helpers import small_llm

    from specdec import SamplingParams, SpeculativeConfig
    from specdec.model.quant import native

    if not native.available():
        pytest.skip("no AVX-512 VNNI or no C compiler here")
    path = tmp_path / "tiny.gguf"
    write_k_quant_gguf(path, "qwen2", monkeypatch)
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    plain = small_llm(str(path), dtype="bfloat16", max_model_len=128, quantization="gguf")
    expected = plain.generate(["hello world the"], params)[0].outputs[0].token_ids
    spec = small_llm(str(path), dtype="bfloat16", max_model_len=128, quantization="gguf",
                     speculative=SpeculativeConfig(method="draft_model", draft_model=str(path),
                                                   draft_quantization="gguf", num_speculative_tokens=3))
    out = spec.generate(["hello world the"], params)[0]
    assert out.outputs[0].token_ids == expected
    assert out.metrics["accepted"] > 0  # the same weights as a draft: drafts are accepted
