"""A GGUF file's tokenizer (``tokenizer.*`` metadata) as the upstream ``tokenizer.json``, ``tokenizer_config.json``
and ``generation_config.json`` would have it: byte-level BPE with the family's pre-tokenizer, its added tokens and
every end-of-turn id the family stops on. Used by ``specdec/checkpoint/gguf.py``."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

SUPPORTED_PRE_TOKENIZERS = ("llama-bpe", "qwen2", "smollm")
_CONTROL, _USER_DEFINED = 3, 4  # `tokenizer.ggml.token_type` values (gguf.TokenType) of added tokens
# Every end-of-turn / end-of-text token a family's generation stops on (HF generation_config.json), by architecture
# or by pre-tokenizer (Llama 3 shares the "llama" architecture with SmolLM2).
_FAMILY_EOS_TOKENS = {"qwen2": ("<|im_end|>", "<|endoftext|>"),
                      "llama-bpe": ("<|end_of_text|>", "<|eom_id|>", "<|eot_id|>")}
# Qwen2's split regex (transformers `models/qwen2/tokenization_qwen2.py::PRETOKENIZE_REGEX`).
_QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


# Llama 3's split regex (its tokenizer.json; llama.cpp's LLAMA_VOCAB_PRE_TYPE_LLAMA3): Qwen2's, digits in runs of 1-3
_LLAMA3_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


def _pre_tokenizer(pre: str) -> pre_tokenizers.PreTokenizer:
    """The upstream tokenizer.json's pre-tokenizer for a `tokenizer.ggml.pre` name (llama.cpp's naming)."""
    if pre == "llama-bpe":
        split = pre_tokenizers.Split(Regex(_LLAMA3_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "qwen2":
        split = pre_tokenizers.Split(Regex(_QWEN2_SPLIT), behavior="isolated", invert=False)
        return pre_tokenizers.Sequence([split, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    if pre == "smollm":
        digits = pre_tokenizers.Digits(individual_digits=True)
        return pre_tokenizers.Sequence([digits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    raise ValueError(f"unsupported GGUF pre-tokenizer {pre!r}; supported: {list(SUPPORTED_PRE_TOKENIZERS)}")


def _indices(values: list[int], wanted: int) -> list[int]:
    return [i for i, value in enumerate(values) if value == wanted]


def _special_token(tokens: list[str], md, key: str) -> str | None:
    token_id = md.get(f"tokenizer.ggml.{key}_token_id")
    return None if token_id is None else tokens[token_id]


def _byte_level_bpe(tokens: list[str], merges: list[str], pre: str, types: list[int]) -> Tokenizer:
    """The BPE model, pre-tokenizer, decoder and added tokens; ids are positions in the GGUF token list."""
    pre_tokenizer = _pre_tokenizer(pre)  # fail on an unknown pre-tokenizer before building anything
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    pairs = [tuple(merge.split(" ", 1)) for merge in merges]
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=pairs, fuse_unk=False, byte_fallback=False))
    if pre == "qwen2":
        tokenizer.normalizer = normalizers.NFC()  # as upstream Qwen2's tokenizer.json (a GGUF cannot say so)
    tokenizer.pre_tokenizer = pre_tokenizer
    tokenizer.decoder = decoders.ByteLevel()
    # NOTE: control tokens (type 3) are special; user-defined ones (4) are added tokens that are not special,
    # which is how llama.cpp's converter labelled them (HF `added_tokens` with `special: false`). Both are
    # matched whole in the text and keep their GGUF ids.
    control = [AddedToken(tokens[i], special=True, normalized=False) for i in _indices(types, _CONTROL)]
    user = [AddedToken(tokens[i], special=False, normalized=False) for i in _indices(types, _USER_DEFINED)]
    tokenizer.add_special_tokens(control)
    tokenizer.add_tokens(user)
    return tokenizer


def build_tokenizer(md, arch: str) -> tuple[Tokenizer, dict[str, Any], dict[str, Any]]:
    """`(tokenizer, tokenizer_config, generation_config)` from the `tokenizer.*` metadata."""
    if (kind := md.require("tokenizer.ggml.model")) != "gpt2":
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE)")
    tokens: list[str] = md.require("tokenizer.ggml.tokens")
    pre, types = md.get("tokenizer.ggml.pre", "default"), md.get("tokenizer.ggml.token_type") or []
    tokenizer = _byte_level_bpe(tokens, md.require("tokenizer.ggml.merges"), pre, types)
    bos, eos = _special_token(tokens, md, "bos"), _special_token(tokens, md, "eos")
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", False))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:  # neither supported family sets these; honour them rather than drop them
        single = ([f"{bos}:0"] if add_bos else []) + ["$A:0"] + ([f"{eos}:0"] if add_eos else [])
        specials = [(t, tokenizer.token_to_id(t)) for t, on in ((bos, add_bos), (eos, add_eos)) if on and t]
        tokenizer.post_processor = processors.TemplateProcessing(single=single, special_tokens=specials)
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "pad_token": _special_token(tokens, md, "padding"),
        "unk_token": _special_token(tokens, md, "unknown"),
        "add_bos_token": add_bos,
        "add_eos_token": add_eos,
        "clean_up_tokenization_spaces": False,
        "model_max_length": md.require(f"{arch}.context_length"),
    }
    if (template := md.get("tokenizer.chat_template")) is not None:
        tokenizer_config["chat_template"] = template
    return tokenizer, tokenizer_config, _generation_config(tokenizer, md, arch, pre)


def _generation_config(tokenizer: Tokenizer, md, arch: str, pre: str) -> dict[str, Any]:
    """bos / pad ids and every eos id the family stops on (an int when there is one, as HF writes it)."""
    eos_ids = [md.get(f"tokenizer.ggml.{key}_token_id") for key in ("eos", "eot", "eom")]
    family = _FAMILY_EOS_TOKENS.get(arch, ()) + _FAMILY_EOS_TOKENS.get(pre, ())  # by architecture or tokenizer
    eos_ids += [tokenizer.token_to_id(t) for t in family]  # None when absent
    eos_ids = list(dict.fromkeys(i for i in eos_ids if i is not None))
    config = {"bos_token_id": md.get("tokenizer.ggml.bos_token_id"), "eos_token_id": eos_ids}
    if (pad := md.get("tokenizer.ggml.padding_token_id")) is not None:
        config["pad_token_id"] = pad
    if len(eos_ids) == 1:
        config["eos_token_id"] = eos_ids[0]
    return config
