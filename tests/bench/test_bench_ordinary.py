"""bench.speed.ordinary without models: the workloads' prompts, the rotation of engines (each request once per
engine), the per-group summary and the geometric mean."""

from types import SimpleNamespace

import pytest

from bench.speed import ordinary

pytestmark = pytest.mark.bench


class FakeTokenizer:
    def apply_chat_template(self, messages, add_generation_prompt):
        return "<user>" + messages[0]["content"]

    def encode(self, text):
        return [len(text)]


def test_workloads_have_the_promised_shape():
    kinds = ordinary.workload_requests("kinds", FakeTokenizer())
    assert [g for g, _ in kinds] == [k for k in ordinary.KINDS for _ in range(4)]  # 4 prompts per kind
    repetitive = ordinary.workload_requests("repetitive", FakeTokenizer())
    assert len(repetitive) == 32
    assert [g for g, _ in repetitive[:8]] == ["edit"] * 8 and [g for g, _ in repetitive[-8:]] == ["question"] * 8


class FakeEngine:
    def __init__(self, name, calls, tokens, seconds):
        self.name, self.calls, self.tokens, self.seconds = name, calls, tokens, seconds

    def generate(self, prompt_token_ids, sampling_params):
        self.calls.append(self.name)
        metrics = {"num_rounds": 2, "mean_tokens_per_round": 2.5, "drafted": 8, "accepted": 3, "alpha": 0.6,
                   "k_per_step": [4, 4], "per_position_acceptance": []}
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(self.tokens))], metrics=metrics, error=None)]


def test_run_rotates_the_order_and_summarize_reports_per_group(monkeypatch):
    calls = []
    engines = {"plain": FakeEngine("plain", calls, [1, 2, 3, 4], 2.0),
               "fast": FakeEngine("fast", calls, [1, 2, 3, 4], 1.0)}
    clock = iter(range(1000))
    # perf_counter: start, end per call; the engine's seconds decide the gap
    times = []
    for name in ["plain", "fast", "fast", "plain", "plain", "fast"]:
        t = next(clock) * 10.0
        times += [t, t + engines[name].seconds]
    it = iter(times)
    monkeypatch.setattr(ordinary.time, "perf_counter", lambda: next(it))
    runs = ordinary.run(engines, [("a", [1]), ("a", [2]), ("b", [3])], params=None)
    assert calls == ["plain", "fast", "fast", "plain", "plain", "fast"]  # the order rotates per request
    out = ordinary.summarize(runs, ["a", "b"])
    assert out["a"]["fast"]["speedup"] == pytest.approx(2.0) and out["b"]["fast"]["speedup"] == pytest.approx(2.0)
    assert out["a"]["fast"]["tau"] == pytest.approx(2.5) and out["all"]["fast"]["lossless"] is True
    assert ordinary.geomean([1.0, 4.0]) == pytest.approx(2.0)


def test_ceiling_is_tau_over_the_window_cost(tmp_path, monkeypatch):
    import json

    from bench.speed import ordinary_ceiling

    assert ordinary_ceiling.window_width({"method": "prompt_lookup", "num_speculative_tokens": 4}) == 5
    assert ordinary_ceiling.window_width({"method": "recycle", "num_speculative_tokens": 5}) == 17
    assert ordinary_ceiling.window_width({"method": "recycle", "num_speculative_tokens": 4, "tree_budget": 8}) == 9
    assert ordinary_ceiling.interpolate([1, 5, 9], [1.0, 1.4, 2.2], 7) == pytest.approx(1.8)
    assert ordinary_ceiling.interpolate([1, 5, 9], [1.0, 1.4, 2.2], 17) == pytest.approx(3.8)  # extrapolated
    run = {"configs": {"plain": None, "pl": {"method": "prompt_lookup", "num_speculative_tokens": 4}},
           "results": {"qa": {"plain": {"speedup": 1.0}, "pl": {"tau": 2.8, "speedup": 1.3}},
                       "all": {"plain": {"speedup": 1.0}, "pl": {"tau": 2.8, "speedup": 1.3}}}}
    cost = {"results": [{"batch": 1, "width": 1, "v": 1.0}, {"batch": 1, "width": 5, "v": 1.4},
                        {"batch": 8, "width": 5, "v": 3.0}]}
    (tmp_path / "run.json").write_text(json.dumps(run))
    (tmp_path / "cost.json").write_text(json.dumps(cost))
    captured = {}
    monkeypatch.setattr(ordinary_ceiling, "write_json", lambda name, payload, record: captured.update(payload))
    ordinary_ceiling.main([str(tmp_path / "run.json"), str(tmp_path / "cost.json")])
    (row,) = captured["results"]  # "all" left out; batch 8's cost not used
    assert row["ceiling"] == pytest.approx(2.0) and row["tau_needed_for_goal"] == pytest.approx(2.8)
