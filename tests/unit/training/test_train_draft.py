"""``specdec train-draft``: training an EAGLE-3 head on a tiny target's own answers lowers the loss, writes the
published layout, and gives a head that loads, drafts losslessly and is accepted well above an untrained head's
rate on its training prompts; resuming continues the same run; bad options fail with ``ValueError``.

The tiny target keeps its residual stream close to the token embedding (``layer_output_scale``), so its next
token is learnable from the states the head sees (as in test_eagle3.py).
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from helpers import small_llm
from safetensors.torch import load_file
from tiny_models import make_tiny_model

from specdec.checkpoint.eagle3 import check_layout, published_tensors
from specdec.cli import main
from specdec.model.eagle3 import Eagle3Config, default_aux_layers
from specdec.training import TrainDraftConfig, train_draft
from specdec.training.data import load_samples
from specdec.training.evaluate import acceptance
from specdec.training.head import load_train_head
from specdec.training.ttt import unroll

LAYERS, HIDDEN, VOCAB, HEADS, KV_HEADS, MLP = 4, 64, 300, 4, 2, 128  # make_tiny_model's shapes
STEPS, K = 60, 3
LLM_KW = dict(block_size=4, max_model_len=256, num_kv_blocks=2000)
# tau (tokens per verification round, bonus included) a head must reach on its training prompts, k = 3: an
# untrained head gets 1.0 (nothing accepted), the trained one ~3.3
MIN_TAU = 2.0


def options(target, out, **kw) -> TrainDraftConfig:
    base = dict(max_prompts=32, max_new_tokens=24, steps=STEPS, batch_size=8, lr=3e-3, ttt_steps=K,
                dtype="float32", checkpoint_every=20, threads=1)
    return TrainDraftConfig(target, str(out), **(base | kw))


@pytest.fixture(scope="module")
def target(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("train_target"))
    make_tiny_model(path, "llama", seed=3, num_layers=LAYERS, layer_output_scale=0.3)
    return path


@pytest.fixture(scope="module")
def trained(tmp_path_factory, target) -> tuple[str, dict]:
    out = tmp_path_factory.mktemp("trained")
    return str(out), train_draft(options(target, out))


@pytest.fixture(scope="module")
def untrained(tmp_path_factory, target, trained) -> str:
    """A head written after one step at a vanishing learning rate: its initialisation (the mutant)."""
    out = tmp_path_factory.mktemp("untrained")
    shutil.copytree(os.path.join(trained[0], "data"), out / "data")  # the same data, not generated again
    train_draft(options(target, out, steps=1, lr=1e-12))
    return str(out)


def training_prompts(out: str) -> list[list[int]]:
    return [s.prompt_ids for s in load_samples(os.path.join(out, "data", "samples.jsonl"))]


def log(out: str) -> list[dict]:
    with open(os.path.join(out, "train_log.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_training_lowers_the_loss_and_raises_top1(trained):
    out, summary = trained
    history = log(out)
    assert [r["step"] for r in history] == list(range(1, STEPS + 1))
    first = sum(r["loss"] for r in history[:5]) / 5
    last = sum(r["loss"] for r in history[-5:]) / 5
    assert last < 0.5 * first, (first, last)
    assert summary["train"]["steps"] == STEPS
    assert all(a > 0.6 for a in summary["train"]["final_top1"]), summary["train"]["final_top1"]
    assert summary["train"]["warnings"] == []  # a run that learns is not called diverging


# The first 12 losses of three Qwen2.5-Coder-1.5B head trainings (128 prompts, fp32, batch 4, K = 4, D = 8192):
# --lr 2e-3 diverged (the head ended predicting one token), 5e-4 spiked and recovered, 1.5e-4 fell steadily.
QWEN_LOSSES = {
    "2e-3": [13.5, 62.8, 39.3, 44.3, 25.4, 46.2, 26.0, 23.3, 27.6, 24.2, 23.9, 21.6],
    "5e-4": [13.5, 23.9, 13.9, 26.3, 16.4, 13.5, 16.4, 13.5, 12.4, 14.9, 11.8, 9.5],
    "1.5e-4": [13.5, 12.4, 11.3, 11.6, 12.5, 10.7, 11.8, 10.1, 11.0, 10.4, 9.2, 8.8],
}


@pytest.mark.parametrize("lr", list(QWEN_LOSSES))
def test_a_diverging_loss_is_reported_once_the_window_shows_it(lr):
    from specdec.training.trainer import loss_rising

    history = [{"step": i + 1, "loss": x} for i, x in enumerate(QWEN_LOSSES[lr])]
    warnings = [loss_rising(history[:n]) for n in range(1, len(history) + 1)]
    if lr == "2e-3":
        assert warnings[:5] == [None] * 5  # not before window + 1 steps
        assert warnings[5] is not None and "rose from 13.500 at step 1" in warnings[5] and "--lr" in warnings[5]
    else:
        assert warnings == [None] * len(history)


# The published layout, written out from its documentation (SpecForge's LlamaForCausalLMEagle3, vLLM's
# llama_eagle3.py; see test_eagle3.py): hidden H, target hidden Ht, Hq / Hkv heads of size D, MLP I, draft
# vocabulary Vd, target vocabulary V. No embed_tokens: the head uses the target's.
def published_layout(h, ht, hq, hkv, d, i, vd, v) -> dict[str, tuple[int, ...]]:
    return {
        "fc.weight": (h, 3 * ht), "midlayer.hidden_norm.weight": (h,), "midlayer.input_layernorm.weight": (h,),
        "midlayer.self_attn.q_proj.weight": (hq * d, 2 * h), "midlayer.self_attn.k_proj.weight": (hkv * d, 2 * h),
        "midlayer.self_attn.v_proj.weight": (hkv * d, 2 * h), "midlayer.self_attn.o_proj.weight": (h, hq * d),
        "midlayer.post_attention_layernorm.weight": (h,), "midlayer.mlp.gate_proj.weight": (i, h),
        "midlayer.mlp.up_proj.weight": (i, h), "midlayer.mlp.down_proj.weight": (h, i), "norm.weight": (h,),
        "lm_head.weight": (vd, h), "d2t": (vd,), "t2d": (v,),
    }


def test_writes_the_published_layout(trained):
    out, summary = trained
    with open(os.path.join(out, "config.json")) as f:
        raw = json.load(f)
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"]
    assert raw["num_hidden_layers"] == 1 and raw["target_hidden_size"] == HIDDEN and raw["vocab_size"] == VOCAB
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == list(default_aux_layers(LAYERS))
    vd = raw["draft_vocab_size"]
    assert vd == summary["data"]["draft_vocab_size"]
    tensors = load_file(os.path.join(out, "model.safetensors"))
    config = Eagle3Config.from_json(out)
    check_layout(tensors, config, out)
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    assert shapes == published_layout(HIDDEN, HIDDEN, HEADS, KV_HEADS, HIDDEN // HEADS, MLP, vd, VOCAB)
    required, optional = published_tensors(config)
    assert shapes == required | {"t2d": optional["t2d"], **({"d2t": (vd,)} if "d2t" not in required else {})}
    assert tensors["d2t"].dtype == torch.int64 and tensors["t2d"].dtype == torch.bool
    target_ids = torch.arange(vd) + tensors["d2t"]
    assert torch.equal(torch.nonzero(tensors["t2d"]).flatten(), target_ids)  # ascending, marked in t2d


def test_unrolled_steps_match_the_dense_reference(trained, target):
    """Step j, row p of the training-time test is the head's q after the context ``tokens[:p + 2]`` and the
    drafted path ``tokens[p + 2 : p + 2 + j]`` - computed by test_eagle3's dense EAGLE-3 written from the published
    description, fed transformers' hidden states (so training optimises what the proposer drafts with)."""
    from eagle3_helpers import ReferenceHead

    out, _ = trained
    ref = ReferenceHead(out, target)
    head, _, _ = load_train_head(out, max_positions=64)
    tokens = load_samples(os.path.join(out, "data", "samples.jsonl"))[0].ids[:24]
    aux = ref.target_hidden(tokens)[None]  # (1, T, 3H)
    embedding = ref.hf.model.embed_tokens.weight.detach()
    with torch.no_grad():
        probs = [head.logits(x)[0].softmax(-1) for x in unroll(head, embedding, torch.tensor([tokens]), aux, K)]
    checked = 0
    for j in range(K):
        for p in range(0, len(tokens) - 2 - j, 2):
            q = ref.path_q(tokens[: p + 2], tokens[p + 2 : p + 2 + j])
            torch.testing.assert_close(probs[j][p], q[ref.target_ids], atol=2e-5, rtol=1e-4)
            checked += 1
    assert checked > 20


def test_trained_head_loads_drafts_losslessly_and_is_accepted(trained, untrained, target):
    """Greedy output with the head equals plain decoding; on its training prompts the trained head's tau clears
    MIN_TAU, and the untrained head (same init, no training) fails the same assertion."""
    from specdec import SamplingParams

    out, _ = trained
    prompts = training_prompts(out)
    trained_run = acceptance(target, out, prompts, max_tokens=24, k=K, **LLM_KW)
    plain = small_llm(target, dtype="float32", **LLM_KW)
    want = plain.generate(prompt_token_ids=prompts, sampling_params=SamplingParams(temperature=0, max_tokens=24,
                                                                                  ignore_eos=True))
    assert trained_run["token_ids"] == [list(o.outputs[0].token_ids) for o in want]
    assert trained_run["tau"] >= MIN_TAU, trained_run["tau"]
    untrained_run = acceptance(target, untrained, prompts, max_tokens=24, k=K, **LLM_KW)
    assert untrained_run["token_ids"] == trained_run["token_ids"]
    assert not untrained_run["tau"] >= MIN_TAU, untrained_run["tau"]  # the mutant is caught


def test_resume_continues_the_same_run(tmp_path, target, trained, monkeypatch):
    """A run of 20 steps interrupted (Ctrl-C) in step 13, after its checkpoint at 10, and resumed: the same
    steps and losses as the uninterrupted run."""
    import specdec.training.trainer as trainer

    runs = {}
    for name in ("whole", "split"):
        out = tmp_path / name
        shutil.copytree(os.path.join(trained[0], "data"), out / "data")
        if name == "split":
            calls = {"n": 0}
            real = trainer.ttt_loss

            def interrupted(*args, _calls=calls, _real=real, **kwargs):
                _calls["n"] += 1
                if _calls["n"] == 13:
                    raise KeyboardInterrupt
                return _real(*args, **kwargs)

            with monkeypatch.context() as m:
                m.setattr(trainer, "ttt_loss", interrupted)
                with pytest.raises(KeyboardInterrupt):
                    train_draft(options(target, out, steps=20, checkpoint_every=10))
            assert len(log(str(out))) == 12  # steps 11 and 12 done, not checkpointed: the resumed run redoes them
            with pytest.raises(ValueError, match="--resume"):
                train_draft(options(target, out, steps=20, checkpoint_every=10))
            train_draft(options(target, out, steps=20, checkpoint_every=10, resume=True))
        else:
            train_draft(options(target, out, steps=20, checkpoint_every=10))
        runs[name] = log(str(out))
    assert [r["step"] for r in runs["split"]] == list(range(1, 21))
    torch.testing.assert_close([r["loss"] for r in runs["split"]], [r["loss"] for r in runs["whole"]])


def test_cli_with_self_prompts(tmp_path, target, capsys):
    """``specdec train-draft`` end to end, the target writing its own prompts from an empty user turn."""
    out = tmp_path / "cli"
    code = main(["train-draft", target, str(out), "--self-prompts", "4", "--max-new-tokens", "8", "--steps", "2",
                 "--ttt-steps", "2", "--dtype", "float32", "--threads", "1", "--draft-vocab-size", "100"])
    assert code == 0
    with open(out / "data" / "prompts.json") as f:
        prompts = json.load(f)
    assert len(prompts) == 4 and all(isinstance(p, str) and p for p in prompts)
    assert Eagle3Config.from_json(str(out)).draft_vocab_size == 100
    assert "wrote the head" in capsys.readouterr().out


@pytest.mark.parametrize("kwargs, match", [
    (dict(prompts="p.jsonl", self_prompts=3), "not both"),
    (dict(ttt_steps=0), "--ttt-steps"),
    (dict(lr=0.0), "--lr"),
    (dict(device="tpu"), "--device"),
    (dict(prompts="/nonexistent/prompts.jsonl"), "does not exist"),
    (dict(draft_vocab_size=VOCAB + 1), "--draft-vocab-size"),
])
def test_bad_options_raise_value_error(tmp_path, target, kwargs, match):
    with pytest.raises(ValueError, match=match):
        train_draft(options(target, tmp_path / "bad", **kwargs))


def test_cli_reports_bad_options(tmp_path, target, capsys):
    code = main(["train-draft", target, str(tmp_path / "x"), "--batch-size", "0"])
    assert code == 2
    assert "--batch-size" in capsys.readouterr().err
