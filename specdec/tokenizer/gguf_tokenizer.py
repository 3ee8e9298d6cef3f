"""A GGUF file's tokenizer (``tokenizer.*`` metadata) as the upstream ``tokenizer.json``, ``tokenizer_config.json``
and ``generation_config.json`` would have it: byte-level BPE with the family's pre-tokenizer (``tokenizer.ggml.model``
"gpt2"), or a SentencePiece BPE vocabulary ("llama": Llama 2, Mistral-7B) as transformers converts it; its added
tokens and every end-of-turn id the family stops on. Used by ``specdec/checkpoint/gguf.py``."""

from __future__ import annotations

from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers, processors

# of byte-level BPE ("gpt2") vocabularies; other names llama.cpp writes for the same splits (transformers' table)
_PRE_TOKENIZER_ALIASES = {"llama3": "llama-bpe", "llama-v3": "llama-bpe", "smaug-bpe": "llama-bpe",
                          "deepseek-r1-qwen": "qwen2"}
SUPPORTED_PRE_TOKENIZERS = ("llama-bpe", "qwen2", "smollm", *_PRE_TOKENIZER_ALIASES)
SUPPORTED_TOKENIZER_MODELS = ("gpt2", "llama")  # byte-level BPE, SentencePiece BPE
_METASPACE = "\u2581"  # SentencePiece's visible space
_UNKNOWN, _CONTROL, _USER_DEFINED = 2, 3, 4  # `tokenizer.ggml.token_type` values (gguf.TokenType) of added tokens
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


def _token_ids(tokens: list[str]) -> dict[str, int]:
    """token -> id, a token listed twice keeping its first id (as llama.cpp's lookup does)."""
    vocab: dict[str, int] = {}
    for index, token in enumerate(tokens):
        vocab.setdefault(token, index)
    return vocab


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
    vocab = _token_ids(tokens)
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


def _sentencepiece_bpe(tokens: list[str], scores: list[float], types: list[int], unk: str | None,
                       add_space_prefix: bool) -> Tokenizer:
    """A SentencePiece BPE vocabulary (``tokenizer.ggml.model = "llama"``: pieces spelled with U+2581 for a space,
    ``<0xNN>`` byte pieces, a score per piece) as transformers' GGUF conversion builds it (``LlamaTokenizer``): BPE
    whose merges are recovered from the scores, byte fallback, a Metaspace pre-tokenizer that prefixes one space to
    the text's start (transformers' non-legacy "first" scheme; llama.cpp also prefixes the text after each special
    token), and the matching decoder. ``add_space_prefix`` False (``tokenizer.ggml.add_space_prefix``, written from
    the SentencePiece model's ``add_dummy_prefix``) prefixes nothing, as llama.cpp does; transformers ignores the
    key and prefixes anyway."""
    vocab = _token_ids(tokens)
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges_from_scores(tokens, scores), unk_token=unk,
                                     fuse_unk=True, byte_fallback=True))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace(
        replacement=_METASPACE, prepend_scheme="first" if add_space_prefix else "never", split=False)
    steps = [decoders.Replace(_METASPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    tokenizer.decoder = decoders.Sequence(steps + ([decoders.Strip(" ", 1, 0)] if add_space_prefix else []))
    # the unknown piece is special too (transformers registers it as the unk_token): matched whole, skipped when
    # decoding with skip_special_tokens
    tokenizer.add_special_tokens([AddedToken(tokens[i], special=True, normalized=False)
                                  for i in _indices(types, _UNKNOWN) + _indices(types, _CONTROL)])
    tokenizer.add_tokens([AddedToken(tokens[i], special=False, normalized=False)
                          for i in _indices(types, _USER_DEFINED)])
    return tokenizer


def merges_from_scores(tokens: list[str], scores: list[float]) -> list[tuple[str, str]]:
    """BPE merges implied by a SentencePiece vocabulary: every split of a piece into two pieces of the vocabulary,
    ranked by the merged piece's score (highest first; ties: the longer left part, then the longer right part), as
    transformers' ``generate_merges`` ranks them, so that both tokenizers agree on every text."""
    vocab = _token_ids(tokens)
    candidates = []
    for piece, score in dict(zip(tokens, scores)).items():
        local = [(piece[:i], piece[i:], score) for i in range(1, len(piece))
                 if piece[:i] in vocab and piece[i:] in vocab]
        candidates += sorted(local, key=lambda m: (vocab[m[0]], vocab[m[1]]))
    candidates.sort(key=lambda m: (m[2], len(m[0]), len(m[1])), reverse=True)
    return [(left, right) for left, right, _ in candidates]


def build_tokenizer(md, arch: str) -> tuple[Tokenizer, dict[str, Any], dict[str, Any]]:
    """`(tokenizer, tokenizer_config, generation_config)` from the `tokenizer.*` metadata."""
    kind = md.require("tokenizer.ggml.model")
    if kind not in SUPPORTED_TOKENIZER_MODELS:
        raise ValueError(f"unsupported GGUF tokenizer model {kind!r}; supported: 'gpt2' (byte-level BPE) and "
                         f"'llama' (SentencePiece BPE)")
    tokens: list[str] = md.require("tokenizer.ggml.tokens")
    pre, types = md.get("tokenizer.ggml.pre", "default"), md.get("tokenizer.ggml.token_type") or []
    pre = _PRE_TOKENIZER_ALIASES.get(pre, pre)  # one name per split from here on
    if kind == "gpt2":
        tokenizer = _byte_level_bpe(tokens, md.require("tokenizer.ggml.merges"), pre, types)
    else:
        tokenizer = _sentencepiece_bpe(tokens, md.require("tokenizer.ggml.scores"), types,
                                       _special_token(tokens, md, "unknown"),
                                       bool(md.get("tokenizer.ggml.add_space_prefix", True)))
    bos, eos = _special_token(tokens, md, "bos"), _special_token(tokens, md, "eos")
    # a SentencePiece file that does not say gets BOS, as llama.cpp and transformers give it
    add_bos = bool(md.get("tokenizer.ggml.add_bos_token", kind == "llama"))
    add_eos = bool(md.get("tokenizer.ggml.add_eos_token", False))
    if add_bos or add_eos:  # as the post-processor of the upstream tokenizer.json
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
