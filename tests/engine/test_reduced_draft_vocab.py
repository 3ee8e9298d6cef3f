"""A reduced draft vocabulary (``SpeculativeConfig(draft_vocab=)``): the draft model's LM head keeps the rows of a
subset S of target ids; drafts stay in S, q is exactly 0 outside it, the target still emits every id (greedy output
== plain greedy, chains and trees), penalties see the right ids, the head is cut (not kept whole), the builder
writes a ranked file, and bad files / options fail with a specific message.

The exact-distribution (T > 0) check against the float64 oracle is
tests/lossless/test_reduced_draft_vocab_lossless.py."""

import json
from dataclasses import dataclass

import numpy as np
import pytest
import torch
from helpers import small_llm
from tiny_models import make_tiny_model

import specdec
from specdec import SamplingParams, SpeculativeConfig
from specdec.checkpoint.loader import load_model
from specdec.cli import build_parser, main, speculative_config
from specdec.config import check_draft_tensor_parallel
from specdec.model.linear import Linear
from specdec.model.quant.linear import QuantizedLinear
from specdec.sampling.penalties import row_counts
from specdec.spec_decode.proposers.chain_drafting import sample_draft_step
from specdec.spec_decode.proposers.draft_vocab import DraftVocab, read_draft_vocab, write_draft_vocab
from specdec.spec_decode.round import SpeculativeRound
from specdec.training.vocab_command import build

VOCAB = 300
PROMPTS = [[5, 6, 7, 8], [40, 41, 42, 43, 44, 45, 46], [100, 3, 100, 3, 9], [250, 251, 12]]
GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    """(target, a perturbed untied draft, an unrelated tied draft)."""
    root = tmp_path_factory.mktemp("reduced_vocab")
    target, draft, tied = str(root / "target"), str(root / "draft"), str(root / "tied")
    make_tiny_model(target, "llama", seed=21, vocab_size=VOCAB, lm_head_std=0.3)
    make_tiny_model(draft, "llama", seed=21, vocab_size=VOCAB, perturb_from=target, perturb_scale=0.1)
    make_tiny_model(tied, "llama", seed=22, vocab_size=VOCAB, tie_word_embeddings=True)
    return target, draft, tied


@pytest.fixture(scope="module")
def plain(dirs):
    return small_llm(dirs[0], dtype="float32", block_size=4, max_model_len=128)


@pytest.fixture(scope="module")
def reference(plain):
    return [o.outputs[0].token_ids for o in plain.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.fixture(scope="module")
def subset(reference, tmp_path_factory) -> tuple[str, list[int]]:
    """A JSON list of ids that leaves out every other distinct id the target emits greedily (so the residual / bonus
    path must emit those) and every id = 0 mod 7; (its path, the ids)."""
    emitted = sorted({t for out in reference for t in out})
    left_out = set(emitted[::2]) | set(range(0, VOCAB, 7))
    ids = [t for t in range(VOCAB) if t not in left_out]
    path = tmp_path_factory.mktemp("subset") / "subset.json"
    path.write_text(json.dumps(ids[::-1]))  # any order: the file is a set of ids
    return str(path), ids


def spec_llm(target: str, draft: str, path: str, **spec) -> specdec.LLM:
    return small_llm(target, dtype="float32", block_size=4, max_model_len=128,
                       speculative=SpeculativeConfig(draft_model=draft, num_speculative_tokens=4, draft_vocab=path,
                                                     **spec))


def spy_rounds(llm, monkeypatch) -> dict:
    """Record every round's drafted ids and q rows (the metadata ``SpeculativeRound.verify`` reads)."""
    seen = {"drafted": [], "q": []}
    verify = SpeculativeRound.verify

    def spy(self, logits, out):
        meta = self.meta
        seen["drafted"] += meta.draft_token_ids.tolist()
        if meta.draft_probs is not None:
            seen["q"].append(meta.draft_probs.clone())
        return verify(self, logits, out)

    monkeypatch.setattr(SpeculativeRound, "verify", spy)
    return seen


# --- greedy: the same tokens as the target alone ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [None, [2, 2, 1]], ids=["chain", "tree"])
def test_greedy_equals_plain_and_the_target_emits_ids_outside_the_subset(dirs, reference, subset, shape,
                                                                         monkeypatch):
    path, ids = subset
    tree = {} if shape is None else {"tree": shape, "tree_policy": "always"}
    llm = spec_llm(dirs[0], dirs[1], path, **tree)
    seen = spy_rounds(llm, monkeypatch)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference
    inside = set(ids)
    assert seen["drafted"] and set(seen["drafted"]) <= inside, "a draft left the reduced vocabulary"
    outside = [t for out in reference for t in out if t not in inside]
    assert len(outside) >= 10, "the target emitted too few ids outside the subset: the test proves little"
    accepted = sum(o.metrics["accepted"] for o in outs)
    # the cut head still drafts: accepted drafts (the subset leaves out half of the emitted ids, so far from all)
    assert accepted > 0.1 * sum(o.metrics["drafted"] for o in outs)


def test_a_smaller_draft_vocabulary_and_a_subset_of_it(dirs, tmp_path, monkeypatch):
    """A draft of 280 ids (the suffix cut of tests/engine/test_draft_vocab.py) with a subset of those: ids >= 280 are
    fed to it as the stand-in, ids outside the subset never drafted, and a subset id the draft lacks is refused."""
    small = str(tmp_path / "small")
    make_tiny_model(small, "llama", seed=23, vocab_size=280, lm_head_std=0.3)
    path = tmp_path / "v.json"
    ids = list(range(1, 280, 2))
    path.write_text(json.dumps(ids))
    llm = spec_llm(dirs[0], small, str(path))
    seen = spy_rounds(llm, monkeypatch)
    prompts = PROMPTS + [[290, 5, 299, 6]]  # ids the draft does not have
    ref = [o.outputs[0].token_ids for o in small_llm(dirs[0], dtype="float32", block_size=4, max_model_len=128)
           .generate(prompt_token_ids=prompts, sampling_params=GREEDY)]
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=prompts, sampling_params=GREEDY)] == ref
    assert seen["drafted"] and set(seen["drafted"]) <= set(ids)
    path.write_text(json.dumps([1, 285]))
    with pytest.raises(ValueError, match="token id 285 .* the draft model's vocabulary"):
        spec_llm(dirs[0], small, str(path))


def test_tied_draft_keeps_its_whole_embedding_and_a_cut_head(dirs, reference, subset):
    path, ids = subset
    llm = spec_llm(dirs[0], dirs[2], path)
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == \
        reference
    model = llm.engine.speculative.proposer.runner.model
    assert model.embed_tokens.weight.shape[0] == VOCAB  # the draft still reads every id
    assert isinstance(model.lm_head, Linear) and model.lm_head.out_features == len(ids)
    assert model.lm_head.weight is not model.embed_tokens.weight
    full = load_model(dirs[2], torch.float32, torch.device("cpu"), 128, prepack_weights=False)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(model.logits(hidden), full.logits(hidden)[:, ids])


def test_untied_head_is_cut_and_no_full_head_stays(dirs, subset):
    path, ids = subset
    model = spec_llm(dirs[0], dirs[1], path).engine.speculative.proposer.runner.model
    assert model.lm_head.out_features == len(ids)
    rows = [t.shape[0] for t in [*model.parameters(), *model.buffers()] if t.dim() == 2]
    rows += [m.packed_weight.shape[0] for m in model.modules() if getattr(m, "packed_weight", None) is not None]
    assert rows.count(VOCAB) == 1, "only the embedding may keep a row per target id"
    full = load_model(dirs[1], torch.float32, torch.device("cpu"), 128, prepack_weights=False)
    hidden = torch.randn(3, model.config.hidden_size, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(model.logits(hidden), full.logits(hidden)[:, ids])


def test_quantised_draft_quantises_the_cut_head(dirs, reference, subset):
    path, ids = subset
    llm = spec_llm(dirs[0], dirs[1], path, draft_quantization="int8")
    head = llm.engine.speculative.proposer.runner.model.lm_head
    assert isinstance(head, QuantizedLinear) and head.out_features == len(ids)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)
    assert [o.outputs[0].token_ids for o in outs] == reference


# --- sampled: q is exactly zero outside the subset ---------------------------------------------------------------
@pytest.mark.parametrize("shape", [None, "dynamic"], ids=["chain", "tree"])
def test_sampled_q_is_exactly_zero_outside_the_subset(dirs, subset, shape, monkeypatch):
    path, ids = subset
    tree = {} if shape is None else {"tree": shape, "tree_policy": "always", "tree_budget": 6}
    llm = spec_llm(dirs[0], dirs[1], path, **tree)
    seen = spy_rounds(llm, monkeypatch)
    params = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.3, frequency_penalty=0.5,
                            max_tokens=30, seed=3, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert all(o.outputs[0].finish_reason == "length" for o in outs), [o.error for o in outs]
    outside = torch.ones(VOCAB, dtype=torch.bool)
    outside[ids] = False
    q = torch.cat(seen["q"])
    assert q.shape[1] == VOCAB and bool((q[:, outside] == 0).all()), "q must be exactly 0 outside the subset"
    sums = q.sum(dim=1)
    torch.testing.assert_close(sums[sums > 0], torch.ones_like(sums[sums > 0]))  # rows with a q are distributions
    assert seen["drafted"] and set(seen["drafted"]) <= set(ids)
    again = llm.generate(prompt_token_ids=PROMPTS, sampling_params=params)
    assert [o.outputs[0].token_ids for o in again] == [o.outputs[0].token_ids for o in outs]  # seeded


@dataclass
class _Seq:
    """What ``sample_draft_step`` reads of a request."""

    prompt: list[int]
    output: list[int]
    params: SamplingParams
    seed: int
    grammar: None = None  # no structured output

    @property
    def num_tokens(self) -> int:
        return len(self.prompt) + len(self.output)

    def penalty_counts(self, extra=()):
        return row_counts(self.prompt, self.output + list(extra))


def test_subset_sampling_equals_the_full_vocabulary_masked_to_the_subset(monkeypatch):
    """Sampling over the subset's columns (penalty contexts mapped onto them, drafts mapped back) draws the same
    tokens with the same q as sampling over the whole vocabulary with every id outside S masked off - so the
    penalties see the right ids. A context map off by one column must break it (the check has power)."""
    gen = torch.Generator().manual_seed(5)
    ids = torch.tensor(sorted(torch.randperm(VOCAB, generator=gen)[:90].tolist()))
    vocab = DraftVocab(ids, VOCAB, torch.device("cpu"))
    logits = torch.randn(6, VOCAB, generator=gen) * 3  # [R, V]
    masked = torch.full_like(logits, -1e30)
    masked[:, ids] = logits[:, ids]
    # contexts hold ids inside and outside S, repeated (counts > 1) and prompt-only
    context = ids[::7].tolist() + [t for t in range(VOCAB) if t not in set(ids.tolist())][:20]
    params = [SamplingParams(temperature=0.8, top_k=40, top_p=0.9, repetition_penalty=1.5, presence_penalty=0.7,
                             frequency_penalty=0.6, seed=s) for s in range(6)]
    seqs = [_Seq(context[: 10 + r], context[r : r + 12] * 2, p, 100 + r) for r, p in enumerate(params)]

    def draw(logits_in, v):
        return sample_draft_step(logits_in, seqs, 1, [[] for _ in seqs], [], False, v)

    ref_tokens, ref_q = draw(masked, None)
    tokens, q = draw(logits[:, ids], vocab)
    assert tokens.tolist() == ref_tokens.tolist() and set(tokens.tolist()) <= set(ids.tolist())
    torch.testing.assert_close(q, ref_q[:, ids])
    assert bool((ref_q[:, np.setdiff1d(np.arange(VOCAB), ids.numpy())] == 0).all())

    real = DraftVocab.context
    monkeypatch.setattr(DraftVocab, "context", lambda self, c: None if c is None else
                        ((real(self, c)[0] + 1) % self.size, real(self, c)[1]))
    _, wrong_q = draw(logits[:, ids], vocab)
    assert not torch.allclose(wrong_q, ref_q[:, ids], atol=1e-4), "a shifted penalty map went unnoticed"


# --- the builder and the files -----------------------------------------------------------------------------------
def test_builder_ranks_ids_by_frequency_and_the_engine_takes_the_first_n(dirs, reference, tmp_path, capsys):
    samples = tmp_path / "samples.jsonl"
    samples.write_text("".join(json.dumps({"prompt_ids": p, "answer_ids": a}) + "\n"
                               for p, a in zip(PROMPTS, reference)))
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", dirs[0], str(out), "--samples", str(samples), "--size", "40"]) == 0
    raw = json.loads(out.read_text())
    counts = np.bincount([t for a in reference for t in a], minlength=VOCAB)
    assert raw["target_vocab_size"] == VOCAB and len(raw["token_ids"]) == 40
    assert raw["counts"] == [int(counts[t]) for t in raw["token_ids"]] and raw["counts"] == sorted(raw["counts"],
                                                                                                    reverse=True)
    assert '"coverage"' in capsys.readouterr().out
    top = read_draft_vocab(out, 5, VOCAB, VOCAB)
    assert top.tolist() == sorted(raw["token_ids"][:5])
    llm = spec_llm(dirs[0], dirs[1], str(out), draft_vocab_size=25)
    assert llm.engine.speculative.proposer.runner.model.lm_head.out_features == 25
    assert [o.outputs[0].token_ids for o in llm.generate(prompt_token_ids=PROMPTS, sampling_params=GREEDY)] == \
        reference


def test_builder_generates_the_answers_when_given_no_samples(dirs, tmp_path, capsys):
    out = tmp_path / "vocab.json"
    assert main(["draft-vocab", dirs[0], str(out), "--max-prompts", "3", "--max-new-tokens", "8", "--size", "30"]) == 0
    raw = json.loads(out.read_text())
    assert len(raw["token_ids"]) == 30 and 0 < sum(raw["counts"]) <= 3 * 8  # 3 answers of at most 8 tokens
    assert read_draft_vocab(out, None, VOCAB, VOCAB).numel() == 30


def test_an_eagle3_vocabulary_map_is_read(tmp_path):
    from safetensors.torch import save_file

    from specdec.training.vocab import draft_vocab

    d2t, t2d = draft_vocab([[3, 3, 9, 200, 9, 9]], VOCAB, 16)
    save_file({"d2t": d2t, "t2d": t2d}, str(tmp_path / "vocab.safetensors"))
    torch.save({"d2t": d2t, "t2d": t2d}, tmp_path / "vocab.pt")
    expected = (torch.arange(16) + d2t).tolist()
    assert read_draft_vocab(tmp_path / "vocab.safetensors", None, VOCAB, VOCAB).tolist() == expected
    assert read_draft_vocab(tmp_path / "vocab.pt", None, VOCAB, VOCAB).tolist() == expected
    assert {3, 9, 200} <= set(expected)
    with pytest.raises(ValueError, match="not ranked by frequency"):
        read_draft_vocab(tmp_path / "vocab.pt", 8, VOCAB, VOCAB)
    save_file({"d2t": d2t, "t2d": torch.roll(t2d, 1)}, str(tmp_path / "bad.safetensors"))
    with pytest.raises(ValueError, match="t2d' does not mark exactly"):
        read_draft_vocab(tmp_path / "bad.safetensors", None, VOCAB, VOCAB)


# --- bad input ---------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("content,size,draft_vocab,match", [
    ([], None, VOCAB, "holds no token ids"),
    ([1, 2, 2], None, VOCAB, "token id 2 appears more than once"),
    ([1, VOCAB], None, VOCAB, f"token id {VOCAB} \\(entry 1\\) is outside \\[0, {VOCAB}\\), the target's"),
    ([1, -1], None, VOCAB, "token id -1"),
    ([1, 290], None, 280, "outside \\[0, 280\\), the draft model's vocabulary"),
    ([1, 2, 3], 4, VOCAB, "draft_vocab_size=4 is larger than the 3 ids"),
    ({"token_ids": [1, 2], "target_vocab_size": 500}, None, VOCAB, "built for a vocabulary of 500 ids"),
    ({"ids": [1, 2]}, None, VOCAB, "expected a JSON list of integer token ids"),
    ([1, 2.5], None, VOCAB, "expected a JSON list of integer token ids"),
])
def test_bad_vocabulary_files_are_refused(tmp_path, content, size, draft_vocab, match):
    path = tmp_path / "v.json"
    path.write_text(json.dumps(content))
    with pytest.raises(ValueError, match=match):
        read_draft_vocab(path, size, VOCAB, draft_vocab)


def test_bad_files_fail_when_the_llm_is_built(dirs, tmp_path):
    path = tmp_path / "v.json"
    path.write_text(json.dumps([1, 2, VOCAB + 5]))
    with pytest.raises(ValueError, match=f"token id {VOCAB + 5}"):
        spec_llm(dirs[0], dirs[1], str(path))


@pytest.mark.parametrize("kwargs,match", [
    ({"method": "ngram_table"}, "draft_vocab needs a draft model"),
    ({"method": "prompt_lookup"}, "draft_vocab needs a draft model"),
    ({"method": "eagle3", "draft_model": "x"}, "an EAGLE-3 head carries its own reduced vocabulary"),
    ({"draft_model": "x", "draft_vocab": None, "draft_vocab_size": 10}, "draft_vocab_size needs draft_vocab"),
    ({"draft_model": "x", "draft_vocab_size": 0}, "draft_vocab_size must be None"),
    ({"draft_model": "x", "draft_vocab_size": True}, "draft_vocab_size must be None"),
    ({"draft_model": "x", "draft_vocab": "missing.json"}, "does not exist"),
    ({"draft_model": "x", "draft_vocab": "ids.txt"}, "expected a .json / .safetensors / .pt file"),
    ({"draft_model": "x", "draft_vocab": 5}, "must be the path of a file"),
])
def test_bad_options_are_refused(tmp_path, kwargs, match):
    path = tmp_path / "v.json"
    path.write_text("[1, 2]")
    with pytest.raises(ValueError, match=match):
        SpeculativeConfig(**{"draft_vocab": str(path), **kwargs})


def test_a_sharded_draft_refuses_a_reduced_vocabulary(tmp_path):
    path = tmp_path / "v.json"
    path.write_text("[1, 2]")
    spec = SpeculativeConfig(draft_model="x", draft_vocab=str(path))
    with pytest.raises(ValueError, match="draft_tensor_parallel_size=1"):
        check_draft_tensor_parallel(spec, 2)
    assert check_draft_tensor_parallel(SpeculativeConfig(draft_model="x", draft_vocab=str(path),
                                                         draft_tensor_parallel_size=1), 2) == 1


def test_cli_flags_reach_the_config(tmp_path):
    path = tmp_path / "v.json"
    write_draft_vocab(path, [4, 1, 2], [9, 5, 5], VOCAB)
    args = build_parser().parse_args(["generate", "--prompt", "x", "--speculative-method", "draft_model",
                                      "--draft-model", "d", "--draft-vocab", str(path), "--draft-vocab-size", "2"])
    spec = speculative_config(args)
    assert spec.draft_vocab == str(path) and spec.draft_vocab_size == 2
    args = build_parser().parse_args(["generate", "--prompt", "x", "--draft-vocab", str(path)])
    with pytest.raises(ValueError, match="--draft-vocab(-size)? needs --speculative-method draft_model or combined"):
        speculative_config(args)


def test_builder_refuses_bad_input(dirs, tmp_path):
    with pytest.raises(ValueError, match="--size must be in"):
        build([[1, 2]], VOCAB, VOCAB + 1, tmp_path / "v.json")
    with pytest.raises(ValueError, match="outside the target's vocabulary"):
        build([[1, VOCAB]], VOCAB, 4, tmp_path / "v.json")
    bad = tmp_path / "s.jsonl"
    bad.write_text('{"prompt_ids": [1]}\n')
    assert main(["draft-vocab", dirs[0], str(tmp_path / "v.json"), "--samples", str(bad)]) == 2
    assert main(["draft-vocab", dirs[0], str(tmp_path / "v.txt"), "--samples", str(bad)]) == 2

