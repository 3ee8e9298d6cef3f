"""Tokenizer round trip, chat template as transformers renders it, streaming edge cases, NaN logits."""

import pytest
import torch
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams
from specdec.engine.detokenizer import _held_back, append_text
from specdec.engine.sequence import Sequence
from specdec.tokenizer.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_text")
    make_tiny_model(str(path), "llama", seed=5)
    return str(path)


@pytest.fixture(scope="module")
def llm(model_dir):
    return small_llm(model_dir, dtype="float32", block_size=4, max_model_len=128)


TEXTS = ["Hello, world!", "naïve café — 日本語 🤖", "def f(x):\n    return x ** 2\n", "  spaces   and\ttabs",
         "<|eos|>x"]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_round_trip_and_matches_transformers(model_dir, text):
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(model_dir)
    ref = PreTrainedTokenizerFast(tokenizer_file=f"{model_dir}/tokenizer.json")
    ids = tok.encode(text)
    assert ids == ref.encode(text, add_special_tokens=False)
    assert tok.decode(ids, skip_special_tokens=False) == text


def test_chat_template_is_rendered_as_transformers_renders_it(model_dir):
    from transformers import AutoTokenizer

    ref = AutoTokenizer.from_pretrained(model_dir)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}]
    ours = Tokenizer(model_dir).apply_chat_template(messages)
    assert ours == ref.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    with pytest.raises(ValueError, match="messages must be a list"):
        Tokenizer(model_dir).apply_chat_template([{"role": "user"}])


def test_chat_generates(llm):
    out = llm.chat([{"role": "user", "content": "hello"}], SamplingParams(temperature=0, max_tokens=5))[0]
    assert out.prompt.startswith("<|user|>hello") and 1 <= len(out.outputs[0].token_ids) <= 5


class _FakeTokenizer:
    """Token i decodes to the bytes in table[i] (utf-8, errors replaced) - to plant split characters."""

    def __init__(self, table):
        self.table = table

    def decode(self, ids, skip_special_tokens=True):
        return b"".join(self.table[i] for i in ids).decode("utf-8", errors="replace")


def _seq(stop=None):
    return Sequence(0, "r", None, [1], SamplingParams(stop=stop), 0, frozenset())


def test_streaming_never_shows_partial_utf8():
    euro = "€".encode()  # 3 bytes
    tok = _FakeTokenizer({0: b"a", 1: euro[:1], 2: euro[1:2], 3: euro[2:], 4: b"b"})
    seq = _seq()
    shown = []
    for t in [0, 1, 2, 3, 4]:
        seq.append_token(t)
        append_text(seq, tok)
        shown.append(seq.output_text[: seq.stable_text_len])
    assert shown == ["a", "a", "a", "a€", "a€b"]
    assert all("\ufffd" not in s for s in shown)


def test_streaming_holds_back_a_possible_stop_prefix_and_cuts_at_the_stop():
    tok = _FakeTokenizer({0: b"x", 1: b"EN", 2: b"D", 3: b"y", 4: b"E"})
    seq = _seq(stop=["END"])
    for t in (0, 1):
        seq.append_token(t)
    assert not append_text(seq, tok)
    assert seq.output_text[: seq.stable_text_len] == "x"  # "EN" could begin "END"
    seq.append_token(2)
    assert append_text(seq, tok)
    assert seq.output_text == "x"
    seq2 = _seq(stop=["END"])
    for t in (0, 4, 3):
        seq2.append_token(t)
    assert not append_text(seq2, tok) and seq2.output_text[: seq2.stable_text_len] == "xEy"
    assert _held_back("abcE", ("END", "Ex")) == 1 and _held_back("abc", ("END",)) == 0


def test_stream_yields_text_deltas(llm):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    deltas = list(llm.stream("The cat", params))
    full = llm.generate("The cat", params)[0].outputs[0].text
    assert "".join(deltas) == full and len(deltas) >= 2


def test_nan_logits_are_detected_not_sampled(llm, monkeypatch):
    def nan_forward(*args, **kwargs):
        return torch.full((1, llm.engine.model_config.vocab_size), float("nan"))

    monkeypatch.setattr(llm.engine.runner, "forward", nan_forward)
    for params in (SamplingParams(temperature=0, max_tokens=3), SamplingParams(temperature=1.0, max_tokens=3)):
        out = llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=params)[0]
        assert out.outputs[0].finish_reason == "error" and out.outputs[0].token_ids == []
        assert "FloatingPointError: non-finite logits" in out.error
        assert not llm.engine.has_unfinished_requests()
    monkeypatch.undo()
    bm = llm.engine.block_manager
    assert bm.num_free_blocks == bm.num_blocks
    assert llm.generate(prompt_token_ids=[1, 2, 3], sampling_params=SamplingParams(temperature=0, max_tokens=3))
