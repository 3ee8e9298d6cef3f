"""bench.adaptive_k without models: the shared-process measurement's order and cold starts, the draft weights'
sharing, the arguments a child process gets, and the summary's arithmetic."""

from types import SimpleNamespace

import pytest

from bench import adaptive_k
from bench.e2e import share_draft_weights


class FakeLLM:
    """Records every call (generation or adaptive reset) in one shared list; returns fixed tokens and k per step."""

    def __init__(self, name, calls, tokens, seconds):
        self.name, self.calls, self.tokens, self.seconds = name, calls, tokens, seconds
        self.engine = SimpleNamespace(tokenizer=None, model=None,
                                      speculative=SimpleNamespace(reset_adaptive=lambda: calls.append("reset")))

    def generate(self, prompt_token_ids, sampling_params):
        self.calls.append(self.name)
        return [SimpleNamespace(outputs=[SimpleNamespace(token_ids=list(self.tokens))],
                                metrics={"k_per_step": [2, 2]}, error=None)]


@pytest.fixture
def fake_engines(monkeypatch):
    calls, seconds = [], {"plain": 4.0, "k=1": 2.0, "adaptive": 1.0}
    monkeypatch.setattr(adaptive_k, "new_engine", lambda args, name: FakeLLM(name, calls, [7, 8], seconds[name]))
    monkeypatch.setattr(adaptive_k, "class_ids", lambda args, tokenizer: {"code": [[1], [2]], "prose": [[3]]})
    clock = iter(range(10_000))
    monkeypatch.setattr(adaptive_k, "timed", lambda fn: (float(next(clock) % 3 + 1), fn()))
    return calls


def test_measure_shared_rotates_per_prompt_and_resets_adaptive_before_each_of_its_generations(fake_engines):
    args = SimpleNamespace(reps=3, max_tokens=4)
    runs = adaptive_k.measure_shared(args, ["plain", "k=1", "adaptive"])
    timed_calls = fake_engines[3:]  # after the three warm-ups (no reset: the warm-up's counts are reset later)
    assert fake_engines[:3] == ["plain", "k=1", "adaptive"]
    one_prompt = ["plain", "k=1", "reset", "adaptive",  # repetition 1
                  "k=1", "reset", "adaptive", "plain",  # repetition 2
                  "reset", "adaptive", "plain", "k=1"]  # repetition 3
    assert timed_calls == one_prompt * 3  # two code prompts, one prose prompt
    code = runs["code"]["adaptive"]
    assert len(code) == 3 and all(len(rep["tokens"]) == 2 for rep in code)  # per repetition: one entry per prompt
    assert code[0]["k_per_step"] == [2, 2, 2, 2] and code[0]["errors"] == []
    assert runs["prose"]["plain"][0]["tokens"] == [[7, 8]]
    assert all(rep["seconds"] > 0 for rep in code)


def test_shared_summary_gives_adaptive_over_the_best_fixed_configuration():
    def reps(seconds, tokens=((7, 8, 9, 10),)):
        return [{"seconds": s, "cpu_seconds": s, "tokens": [list(t) for t in tokens], "k_per_step": [3, 4],
                 "errors": []} for s in seconds]

    runs = {"code": {"plain": reps([4.0, 4.0, 4.0]), "k=1": reps([2.0, 2.5, 1.5]), "adaptive": reps([2.2, 2.2, 9.0])}}
    summary = adaptive_k.summarize(runs)["code"]
    assert summary["best_fixed_or_plain"] == "k=1"
    assert summary["adaptive_over_best"] == pytest.approx(2.0 / 2.2)  # medians: 2.0 s and 2.2 s for the same tokens
    assert summary["adaptive_k_per_step"] == {3: 3, 4: 3} and summary["lossless"] is True
    runs["code"]["k=1"][0]["tokens"] = [[7, 8, 9, 11]]
    assert adaptive_k.summarize(runs)["code"]["lossless"] is False


def test_child_argv_drops_what_only_the_parent_reads():
    argv = ["--k", "4", "--old-python", "/old/python", "--isolation", "process", "--reps", "3", "--isolation=shared",
            "--old-python=/x"]
    assert adaptive_k.child_argv(argv) == ["--k", "4", "--reps", "3"]


def test_rotated_lets_every_configuration_lead_in_turn():
    names = ["a", "b", "c"]
    assert [adaptive_k.rotated(names, rep)[0] for rep in range(4)] == ["a", "b", "c", "a"]


def test_old_python_with_shared_isolation_is_refused(capsys):
    with pytest.raises(SystemExit):
        adaptive_k.main(["--isolation", "shared", "--old-python", "/old/python"])
    assert "--old-python runs the previous tree in its own process" in capsys.readouterr().err


def test_share_draft_weights_loads_each_draft_once_and_restores_the_loader(monkeypatch):
    import specdec.spec_decode.proposers.factory as factory

    loads = []

    def fake_load(path, dtype, *args, **kwargs):
        loads.append((path, dtype))
        return object()

    monkeypatch.setattr(factory, "load_model", fake_load)
    with share_draft_weights():
        first = factory.load_model("/draft", "float32", 2049, None, None, "int4")
        again = factory.load_model("/draft", "float32", 2049, None, None, "int4")
        other = factory.load_model("/draft", "float32", 2049, None, None, "int8")
    assert first is again and other is not first
    assert loads == [("/draft", "float32"), ("/draft", "float32")]
    assert factory.load_model is fake_load
