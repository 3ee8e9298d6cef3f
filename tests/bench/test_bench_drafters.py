"""bench.speed.drafters without models: drafter names, the rotation of engines, and the summary's arithmetic."""

from types import SimpleNamespace

import pytest

from bench.speed import drafters

pytestmark = pytest.mark.bench


def test_parse_drafter_accepts_methods_and_models_and_names_what_is_wrong(tmp_path):
    assert drafters.parse_drafter("prompt_lookup") == ("prompt_lookup", None, False)
    assert drafters.parse_drafter(f"eagle3:{tmp_path}") == ("eagle3", str(tmp_path), False)
    assert drafters.parse_drafter(f"draft_model:{tmp_path}+vocab") == ("draft_model", str(tmp_path), True)
    with pytest.raises(ValueError, match=r"\+vocab"):
        drafters.parse_drafter(f"eagle3:{tmp_path}+vocab")
    with pytest.raises(ValueError, match="unknown method 'medusa'; allowed: draft_model"):
        drafters.parse_drafter("medusa:x")
    with pytest.raises(ValueError, match="draft_model needs a model"):
        drafters.parse_drafter("draft_model")
    with pytest.raises(ValueError, match="ngram_table takes no model"):
        drafters.parse_drafter("ngram_table:x")


class FakeEngine:
    """Records the order of calls; returns fixed tokens and metrics."""

    def __init__(self, name, calls, tokens):
        self.name, self.calls, self.tokens = name, calls, tokens

    def generate(self, prompt_token_ids, sampling_params):
        self.calls.append(self.name)
        metrics = {"num_rounds": 2, "mean_tokens_per_round": 2.5, "drafted": 8, "accepted": 3, "alpha": 0.6,
                   "num_generated_tokens": len(self.tokens), "k_per_step": [4, 4], "per_position_acceptance": []}
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(self.tokens))], metrics=metrics,
                                error=None)]


def test_run_class_rotates_the_order_and_sums_over_prompts():
    calls = []
    engines = {"plain": FakeEngine("plain", calls, [1, 2]), "a": FakeEngine("a", calls, [1, 2]),
               "b": FakeEngine("b", calls, [1, 3])}
    runs = drafters.run_class(engines, [[5], [6]], params=None, reps=3)
    per_prompt = ["plain", "a", "b", "a", "b", "plain", "b", "plain", "a"]  # repetitions 1, 2, 3
    assert calls == per_prompt * 2
    assert runs["a"]["tokens"] == [[1, 2], [1, 2]]  # one entry per prompt (the first repetition's)
    assert len(runs["b"]["seconds"]) == 3 and len(runs["b"]["metrics"]) == 2


def test_summary_speedups_against_plain_and_the_token_check():
    def run(tokens, seconds, cpu):
        metrics = [{"num_rounds": 4, "mean_tokens_per_round": 2.0, "drafted": 8, "accepted": 4, "alpha": 0.5,
                    "num_generated_tokens": 8, "k_per_step": [2, 2, 2, 2], "per_position_acceptance": [0.5, 0.5]}]
        return {"tokens": [tokens], "seconds": seconds, "cpu_seconds": cpu, "metrics": metrics}

    runs = {"plain": run([1] * 8, [2.0, 4.0, 3.0], [2.0, 2.0, 2.0]), "fast": run([1] * 8, [1.0, 1.5, 1.0], [1.0] * 3),
            "wrong": run([1] * 7 + [2], [3.0] * 3, [3.0] * 3)}
    costs = {name: {"c": 0.25, "draft_1_ms": 1.0, "target_1_ms": 4.0} for name in ("fast", "wrong")}
    out = drafters.summarize(runs, costs)
    assert out["plain"]["tok_s"] == 8 / 3.0  # the median of 2, 4, 3 s
    assert out["fast"]["speedup"] == pytest.approx(3.0)
    assert out["fast"]["speedup_cpu"] == pytest.approx(2.0)
    assert out["fast"]["tau"] == pytest.approx(2.0) and out["fast"]["acceptance"] == pytest.approx(0.5)
    assert out["fast"]["lossless"] is True and out["wrong"]["lossless"] is False


def test_select_prompts_keeps_the_named_files_and_drops_empty_classes():
    from bench.common import load_prompts

    prompts = load_prompts(["json", "prose"], None)
    assert drafters.select_prompts(prompts, None) is prompts
    kept = drafters.select_prompts(prompts, "03_letter")
    assert list(kept) == ["prose"] and [p.name for p in kept["prose"]] == ["03_letter"]
    assert drafters.select_prompts(prompts, "no_such_prompt") == {}
