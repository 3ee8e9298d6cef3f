"""bench.speed.adaptive_k without models: the shared-process measurement's order and cold starts, the draft weights'
sharing, the arguments a child process gets, and the summary's arithmetic."""

from types import SimpleNamespace

import pytest

from bench.speed import adaptive_k
from bench.speed.e2e import share_draft_weights

pytestmark = pytest.mark.bench


class FakeEngine:
    """One request at a time, ``per_step`` tokens per ``step()``; every step and adaptive reset logged in ``calls``."""

    def __init__(self, name, calls, per_step):
        self.name, self.calls, self.per_step = name, calls, per_step
        self.speculative = SimpleNamespace(reset_adaptive=lambda: calls.append(f"reset {name}"))
        self.tokenizer = self.model = self.request = None

    def add_request(self, prompt_token_ids, params):
        self.request = {"id": f"{self.name}-{len(self.calls)}", "tokens": [], "max": params.max_tokens}
        return self.request["id"]

    def has_unfinished_requests(self):
        return self.request is not None

    def step(self):
        self.calls.append(self.name)
        r = self.request
        r["tokens"] += [7] * min(self.per_step, r["max"] - len(r["tokens"]))
        finished = len(r["tokens"]) == r["max"]
        if finished:
            self.request = None
        out = SimpleNamespace(request_id=r["id"], finished=finished, error=None,
                              outputs=[SimpleNamespace(token_ids=list(r["tokens"]))],
                              metrics={"k_per_step": [self.per_step - 1] * len(r["tokens"])})
        return [out]


class FakeLLM:
    def __init__(self, engine):
        self.engine = engine

    def generate(self, prompt_token_ids, sampling_params):  # the warm-up
        self.engine.calls.append(f"warm {self.engine.name}")


class FakeClock:
    """Stands in for the ``time`` module: each clock advances by 1 s per read, so a step timed between two reads
    lasts exactly 1 s of wall and 1 s of CPU time."""

    def __init__(self):
        self.wall = self.cpu = 0.0

    def perf_counter(self):
        self.wall += 1.0
        return self.wall

    def process_time(self):
        self.cpu += 1.0
        return self.cpu


@pytest.fixture
def fake_engines(monkeypatch):
    calls, per_step = [], {"plain": 1, "k=1": 2, "adaptive": 4}
    monkeypatch.setattr(adaptive_k, "new_engine", lambda args, name: FakeLLM(FakeEngine(name, calls, per_step[name])))
    monkeypatch.setattr(adaptive_k, "class_ids", lambda args, tokenizer: {"code": [[1], [2]], "prose": [[3]]})
    return calls


def test_lockstep_steps_the_engine_furthest_behind_and_resets_adaptive_before_each_generation(fake_engines,
                                                                                           monkeypatch):
    monkeypatch.setattr(adaptive_k, "time", FakeClock())
    engines = {n: adaptive_k.new_engine(None, n) for n in ("plain", "k=1", "adaptive")}
    params = SimpleNamespace(max_tokens=4)
    out = adaptive_k.generate_lockstep(engines, [1], params, ["plain", "k=1", "adaptive"])
    # progress (fraction of 4 tokens) after each step: plain .25, k=1 .5, adaptive 1 (done), plain .5, then the
    # tie plain / k=1 at .5 goes to the first in the order
    assert fake_engines == ["reset adaptive", "plain", "k=1", "adaptive", "plain", "plain", "k=1", "plain"]
    assert {n: len(o["tokens"]) for n, o in out.items()} == {"plain": 4, "k=1": 4, "adaptive": 4}
    assert out["adaptive"]["k_per_step"] == [3] * 4 and out["plain"]["error"] is None
    # each engine is charged its own steps' time, 1 s a step on the fake clock: plain 4 steps, k=1 2, adaptive 1
    assert {n: (o["seconds"], o["cpu_seconds"]) for n, o in out.items()} == {
        "plain": (4.0, 4.0), "k=1": (2.0, 2.0), "adaptive": (1.0, 1.0)}
    # the first two steps of each are its prompt step and first decode step (a draft reads the prompt there); the
    # rest are decode steps filed under the k granted there
    assert {n: {k: len(s) for k, s in o["decode_cpu_seconds"].items()} for n, o in out.items()} == {
        "plain": {0: 2}, "k=1": {}, "adaptive": {}}
    assert {n: o["prefill_cpu_seconds"] for n, o in out.items()} == {"plain": 2.0, "k=1": 2.0, "adaptive": 1.0}
    assert out["plain"]["decode_cpu_seconds"] == {0: [1.0, 1.0]}
    fake_engines.clear()
    adaptive_k.generate_lockstep(engines, [1], params, ["adaptive", "k=1", "plain"])
    assert fake_engines[:4] == ["reset adaptive", "adaptive", "k=1", "plain"]  # ties follow the rotated order


def test_measure_shared_runs_every_prompt_and_repetition_in_a_rotating_order(fake_engines):
    args = SimpleNamespace(reps=3, max_tokens=4)
    runs = adaptive_k.measure_shared(args, ["plain", "k=1", "adaptive"])
    assert fake_engines[:3] == ["warm plain", "warm k=1", "warm adaptive"]
    assert fake_engines.count("reset adaptive") == 3 * 3  # before each of its generations: 3 prompts x 3 reps
    firsts = [fake_engines[i + 1] for i, c in enumerate(fake_engines) if c == "reset adaptive"]
    assert firsts[:3] == ["plain", "k=1", "adaptive"]  # the first step of repetitions 1, 2, 3 of the first prompt
    code = runs["code"]["adaptive"]
    assert len(code) == 3 and all(len(rep["tokens"]) == 2 for rep in code)  # per repetition: one entry per prompt
    assert code[0]["k_per_step"] == [3] * 8 and code[0]["errors"] == []
    assert runs["prose"]["plain"][0]["tokens"] == [[7] * 4]


def test_shared_summary_gives_adaptive_over_the_best_fixed_configuration():
    def reps(seconds, tokens=((7, 8, 9, 10),)):
        return [{"seconds": s, "cpu_seconds": s, "tokens": [list(t) for t in tokens], "k_per_step": [3, 4],
                 "errors": []} for s in seconds]

    runs = {"code": {"plain": reps([4.0, 4.0, 4.0]), "k=1": reps([2.0, 2.5, 1.5]), "adaptive": reps([2.2, 2.2, 9.0])}}
    summary = adaptive_k.summarize(runs)["code"]
    assert summary["best_fixed_or_plain"] == "k=1"
    assert summary["adaptive_over_best"] == pytest.approx(2.0 / 2.2)  # medians: 2.0 s and 2.2 s for the same tokens
    assert summary["adaptive_over_best_paired"] == pytest.approx(2.0 / 2.2)  # per rep: 2/2.2, 2.5/2.2, 1.5/9
    runs["code"]["adaptive"] = reps([2.2, 2.75, 1.65])  # each repetition 10% slower than k=1's beside it
    assert adaptive_k.summarize(runs)["code"]["adaptive_over_best_paired_cpu"] == pytest.approx(1 / 1.1)
    assert summary["adaptive_k_per_step"] == {3: 3, 4: 3} and summary["lossless"] is True
    assert summary["texts_part_at"] == {"plain": None, "k=1": None, "adaptive": None}
    runs["code"]["k=1"][0]["tokens"] = [[7, 8, 9, 11]]
    runs["code"]["adaptive"][2]["tokens"] = [[7, 5, 9, 10]]
    parted = adaptive_k.summarize(runs)["code"]
    assert parted["lossless"] is False
    assert parted["texts_part_at"] == {"plain": None, "k=1": 3, "adaptive": 1}  # the earliest over repetitions


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


def test_configs_are_checked_against_the_known_ones():
    assert adaptive_k.selected_configs(None, 2) == ["plain", "k=1", "k=2", "adaptive"]
    assert adaptive_k.selected_configs("k=2,adaptive", 4) == ["k=2", "adaptive"]
    with pytest.raises(ValueError, match=r"unknown configuration\(s\) \['k=5'\]; allowed: plain, k=1"):
        adaptive_k.selected_configs("k=5,adaptive", 4)


def test_priced_ratio_prices_every_decode_step_at_the_median_time_of_its_k():
    def rep(prefill, steps, tokens=4):
        return {"seconds": 1.0, "cpu_seconds": 1.0, "tokens": [[7] * tokens], "k_per_step": [], "errors": [],
                "prefill_cpu_seconds": prefill, "decode_cpu_seconds": steps}

    runs = {"code": {
        "plain": [rep(0.5, {0: [1.0, 1.0, 1.0]})],
        "k=2": [rep(0.6, {2: [1.5, 1.5]})],  # median 1.5 s a step at k = 2
        "k=4": [rep(0.6, {4: [2.0, 9.0, 2.0]})],  # one slow step: median 2.0 s, measured 13 s
        "adaptive": [rep(0.6, {2: [3.0], 4: [2.0, 2.0]})],  # its k = 2 step slow (3 s): priced 1.5 s
    }}
    s = adaptive_k.summarize(runs)["code"]
    # priced: plain 0.5 + 3 * 1.0 = 3.5 (the best), k=2 0.6 + 2 * 1.5 = 3.6, k=4 0.6 + 3 * 2.0 = 6.6 (measured
    # 13.6); adaptive 0.6 + 1.5 + 2 * 2.0 = 6.1
    assert s["best_priced"] == "plain"
    assert s["adaptive_over_best_priced"] == pytest.approx(3.5 / 6.1)
    assert s["adaptive_step_over_fixed"] == {2: pytest.approx(2.0), 4: pytest.approx(1.0)}
    runs["code"]["adaptive"][0]["decode_cpu_seconds"] = {3: [1.8]}  # a k no fixed configuration took: its own
    assert adaptive_k.summarize(runs)["code"]["adaptive_over_best_priced"] == pytest.approx(3.5 / 2.4)
    for r in runs["code"].values():  # process isolation records no steps: no priced ratio
        r[0].pop("decode_cpu_seconds")
    assert adaptive_k.summarize(runs)["code"]["adaptive_over_best_priced"] is None
