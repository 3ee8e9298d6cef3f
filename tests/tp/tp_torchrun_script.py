"""What tests/tp/test_tp_torchrun.py runs on every rank under torchrun to plant faults (not collected by pytest).

    python -m torch.distributed.run --standalone --nproc-per-node 2 tests/tp/tp_torchrun_script.py MODE TARGET DIR

MODE ``kill-worker``: rank 0 prefills two requests, SIGKILLs rank 1 (its pid is in ``DIR/rank1.pid``) and steps
until they end; it writes their finish reasons and errors, and the engine's health, to ``DIR/rank0.json``.
MODE ``kill-driver``: rank 0 generates once, then SIGKILLs itself; rank 1 writes what its ``LLM(...)`` call raised
to ``DIR/rank1.json``.

torchrun's agent stops the surviving ranks (SIGTERM, then SIGKILL 30 s later) when one fails; the surviving rank
ignores that SIGTERM here, so that what it does with the failure by itself is what the test sees.
"""

import json
import os
import signal
import sys
from pathlib import Path

from specdec import LLM, SamplingParams

OPTS = {"dtype": "float32", "max_model_len": 64, "block_size": 4, "num_kv_blocks": 64, "tensor_parallel_size": 2,
        "distributed_timeout_s": 5.0}
PARAMS = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)


def kill_worker(target: str, out: Path) -> None:
    llm = LLM(target, **OPTS)  # ranks >= 1: serve here until rank 0 shuts down (here: until killed)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    engine = llm.engine
    llm.generate("warm up", SamplingParams(temperature=0, max_tokens=2))
    ids = [engine.add_request("first request", PARAMS), engine.add_request("second one", PARAMS)]
    engine.step()  # both prefilled on every rank
    os.kill(int((out / "rank1.pid").read_text()), signal.SIGKILL)
    final = {}
    for _ in range(100):  # each step is bounded by the collectives' timeout
        for o in engine.step():
            if o.finished:
                final[o.request_id] = o
        if not engine.has_unfinished_requests():
            break
    report = {"finished": sorted(final) == sorted(ids),
              "finish_reasons": [o.outputs[0].finish_reason for o in final.values()],
              "errors": [o.error for o in final.values()], "health_error": engine.health_error}
    llm.shutdown()
    (out / "rank0.json").write_text(json.dumps(report))


def kill_driver(target: str, out: Path) -> None:
    if os.environ["RANK"] != "0":
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            LLM(target, **OPTS)
            raised = "nothing (LLM(...) returned)"
        except SystemExit as e:
            raised = f"SystemExit({e.code})"
        except Exception as e:  # noqa: BLE001 - what the worker's call raised is the result
            raised = f"{type(e).__name__}: {e}"
        (out / "rank1.json").write_text(json.dumps({"raised": raised}))
        return
    llm = LLM(target, **OPTS)
    llm.generate("hello", SamplingParams(temperature=0, max_tokens=3))
    os.kill(os.getpid(), signal.SIGKILL)


def main() -> None:
    mode, target, out = sys.argv[1], sys.argv[2], Path(sys.argv[3])
    (out / f"rank{os.environ['RANK']}.pid").write_text(str(os.getpid()))
    {"kill-worker": kill_worker, "kill-driver": kill_driver}[mode](target, out)


if __name__ == "__main__":
    main()
