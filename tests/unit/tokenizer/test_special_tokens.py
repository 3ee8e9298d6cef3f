"""BOS / EOS as transformers adds them: tokenizer.json's post-processor when it has one (Llama 3 adds
<|begin_of_text|> there; tokenizer_config.json's add_bos_token is then not read), else tokenizer_config.json's
add_bos_token / add_eos_token - checked against transformers' own PreTrainedTokenizerFast on the same files."""

from __future__ import annotations

import json

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models, pre_tokenizers, processors

from specdec.tokenizer.tokenizer import Tokenizer

WORDS = ["<|begin_of_text|>", "<|end_of_text|>", "hello", "world", "the", "cat"]


def folder(tmp_path, post_processor: bool, config: dict):
    vocab = {w: i for i, w in enumerate(WORDS)} | {"[UNK]": len(WORDS)}
    tok = HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens(["<|begin_of_text|>", "<|end_of_text|>"])
    if post_processor:
        tok.post_processor = processors.TemplateProcessing(
            single="<|begin_of_text|> $A", pair="<|begin_of_text|> $A <|begin_of_text|> $B",
            special_tokens=[("<|begin_of_text|>", 0)])
    tok.save(str(tmp_path / "tokenizer.json"))
    cfg = {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", **config}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(cfg))
    return str(tmp_path)


def transformers_ids(path: str, text: str) -> list[int]:
    transformers = pytest.importorskip("transformers")
    return transformers.PreTrainedTokenizerFast.from_pretrained(path)(text)["input_ids"]


CASES = {
    "post-processor adds BOS (Llama 3)": (True, {}),
    "the post-processor wins over the config": (True, {"add_bos_token": False}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_post_processor_decides_as_in_transformers(tmp_path, case):
    post, config = CASES[case]
    path = folder(tmp_path, post, config)
    ours = Tokenizer(path)
    for text in ("hello world", "the cat the", ""):
        assert ours.encode(text) == transformers_ids(path, text), (case, text)
        assert ours.encode(text, add_special_tokens=False) == HFTokenizer.from_file(
            f"{path}/tokenizer.json").encode(text, add_special_tokens=False).ids


def test_without_a_post_processor_the_config_decides(tmp_path):
    """Our one difference from transformers 5 (which then adds nothing): a tokenizer.json without a
    post-processor - what our GGUF conversion writes - takes add_bos_token / add_eos_token from the config."""
    assert Tokenizer(folder(tmp_path, False, {"add_bos_token": True, "add_eos_token": True})).encode("hello") == [
        0, 2, 1]
    assert Tokenizer(folder(tmp_path, False, {})).encode("hello") == [2]


def test_a_text_that_starts_with_bos_does_not_get_it_twice(tmp_path):
    ours = Tokenizer(folder(tmp_path, True, {}))
    assert ours.encode("<|begin_of_text|> hello") == [0, 2]  # a rendered chat template's BOS is kept once
    assert ours.encode("hello") == [0, 2]
