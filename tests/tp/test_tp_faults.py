"""Faults under tensor parallelism (2 gloo ranks on CPU): a worker that is killed, or that hangs (SIGSTOP), ends
the in-flight requests with ``finish_reason "error"`` - at once for a dead worker, after the collectives' timeout
for a hung one - the engine reports itself unhealthy, later requests fail at once (nothing waits on the broken
group again), and ``shutdown()`` returns and leaves no process behind."""

from __future__ import annotations

import os
import signal

import pytest
from helpers import small_llm
from tiny_models import make_tiny_model

from specdec import SamplingParams

OPTS = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "num_kv_blocks": 64}
TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tp_faults") / "target")
    make_tiny_model(path, vocab_size=301, num_heads=4, num_kv_heads=2)
    return path


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGSTOP], ids=["killed", "hung"])
def test_worker_failure_ends_requests_with_an_error(target, sig):
    llm = small_llm(target, tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S, **OPTS)
    engine = llm.engine
    worker = engine.workers.procs[0]
    try:
        params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
        assert llm.generate("warm up", SamplingParams(temperature=0, max_tokens=2))[0].outputs[0].finish_reason
        assert engine.health_error is None
        ids = [engine.add_request("first request", params), engine.add_request("second one", params)]
        engine.step()  # both prefilled on every rank
        os.kill(worker.pid, sig)
        final = {}
        for _ in range(100):  # each step is bounded by the timeout; a broken group fails every later one at once
            for out in engine.step():
                if out.finished:
                    final[out.request_id] = out
            if not engine.has_unfinished_requests():
                break
        assert sorted(final) == sorted(ids)
        for out in final.values():
            assert out.outputs[0].finish_reason == "error"
            assert "tensor-parallel" in out.error, out.error
        assert engine.health_error is not None
        # a request after the failure fails at once instead of waiting on the broken group
        late = llm.generate("too late", params)[0]
        assert late.outputs[0].finish_reason == "error"
    finally:
        llm.shutdown()
    assert not worker.is_alive()
    llm.shutdown()  # idempotent


def test_shutdown_of_a_healthy_engine_stops_its_workers(target):
    with small_llm(target, tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S, **OPTS) as llm:
        procs = list(llm.engine.workers.procs)
        out = llm.generate("hello", SamplingParams(temperature=0, max_tokens=3))[0]
        assert out.outputs[0].finish_reason == "length"
    assert all(p.exitcode == 0 for p in procs)  # asked to stop, not killed


def test_server_reports_unhealthy_after_a_worker_dies(target):
    import json
    import urllib.error
    import urllib.request

    from serve_helpers import ServerThread

    def get_health() -> tuple[int, dict]:
        try:
            with urllib.request.urlopen(f"{server.base_url}/health", timeout=30) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    server = ServerThread(target, tensor_parallel_size=2, distributed_timeout_s=TIMEOUT_S, **OPTS).start()
    try:
        assert get_health()[0] == 200
        os.kill(server.llm.engine.workers.procs[0].pid, signal.SIGKILL)
        server.llm.engine.workers.procs[0].join(10)
        status, body = get_health()
        assert status == 503 and "tensor-parallel worker" in body["error"], body
        try:  # the request ends (with an error), it does not hang
            out = server.client().completions.create(model="tiny", prompt="hi", max_tokens=4)
            assert out.choices[0].finish_reason == "error"
        except Exception as e:  # noqa: BLE001 - an HTTP error is an acceptable way to end it
            assert "error" in str(e).lower()
    finally:
        server.stop()
        server.llm.shutdown()
    assert not any(p.is_alive() for p in server.llm.engine.workers.procs)
