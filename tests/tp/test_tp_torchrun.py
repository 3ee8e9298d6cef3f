"""Tensor parallelism launched by torchrun (``python -m torch.distributed.run --standalone --nproc-per-node 2``,
2 gloo ranks on CPU): the documented example (docs/examples/tp_torchrun.py) gives one process's greedy tokens,
plain and speculative, with the store hosted by torchrun's agent or by rank 0, and every rank exits 0 after rank
0's shutdown; a killed worker ends rank 0's requests with "error"; a killed rank 0 ends the workers' ``LLM(...)``
call with an error; a launch whose WORLD_SIZE is not tensor_parallel_size is refused. Two agents meeting at a
rendezvous endpoint (the multi-node recipe's shape, both on this machine) give the same tokens."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import small_llm

from specdec import SamplingParams

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "docs" / "examples" / "tp_torchrun.py"
FAULT_SCRIPT = Path(__file__).resolve().parent / "tp_torchrun_script.py"
PROMPTS = ["hello there, the cat", "the cat sat on the mat, the cat sat on the", "in the beginning"]
MAX_TOKENS = 16
LAUNCH_BOUND_S = 240  # a hang guard (start-up of 3 interpreters on a busy 2-core machine), not a timing check


def torchrun(script: Path, *args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """``script args`` on 2 local ranks under torchrun (``--standalone``: a c10d rendezvous on a free port)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(script), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=LAUNCH_BOUND_S, cwd=REPO,
                          env={**os.environ, "OMP_NUM_THREADS": "1", **(env or {})})


def example_tokens(target: str, *args: str, env: dict[str, str] | None = None) -> list[list[int]]:
    """The example's greedy tokens for PROMPTS under torchrun (asserting every rank exited 0)."""
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    run = torchrun(EXAMPLE, target, "--dtype", "float32", "--kv-cache-memory-gb", "0.01", "--max-tokens",
                   str(MAX_TOKENS), *prompts, *args, env=env)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    lines = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
    assert [line["prompt"] for line in lines] == PROMPTS, run.stdout  # printed once: by rank 0 alone
    return [line["token_ids"] for line in lines]


@pytest.fixture(scope="module")
def reference(tiny_pair):
    """One process's greedy tokens, with the example's sampling parameters."""
    llm = small_llm(tiny_pair[0], dtype="float32", kv_cache_memory_gb=0.01)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, SamplingParams(temperature=0, max_tokens=MAX_TOKENS))]


@pytest.mark.parametrize("label", ["plain, store on rank 0", "speculative, agent's store"])
def test_greedy_tokens_match_one_process(tiny_pair, reference, label):
    """Plain decoding with the store hosted by rank 0 (``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``: torchrun does not
    share its agent's store, so the env:// rendezvous makes rank 0 host one); speculative decoding with the draft
    sharded over both ranks, on the agent's store (torchrun's default)."""
    if label.startswith("plain"):
        tokens = example_tokens(tiny_pair[0], env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"})
    else:
        tokens = example_tokens(tiny_pair[0], "--draft", tiny_pair[1], "--k", "3")
    assert tokens == reference


def test_two_agents_with_a_rendezvous_endpoint(tiny_pair, reference):
    """The multi-node recipe's shape on one machine: two torchrun agents (``--nnodes 2 --nproc-per-node 1``) meet
    at a c10d rendezvous endpoint on 127.0.0.1; the rank-0 node prints the tokens, both agents exit 0."""
    with socket.socket() as s:  # a free port for the endpoint (released again: the first agent binds it)
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    prompts = [a for p in PROMPTS for a in ("--prompt", p)]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node", "1", "--rdzv-backend",
           "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", "specdec-test", str(EXAMPLE), tiny_pair[0],
           "--dtype", "float32", "--kv-cache-memory-gb", "0.01", "--max-tokens", str(MAX_TOKENS), *prompts]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env)
              for _ in range(2)]
    try:
        outs = [a.communicate(timeout=LAUNCH_BOUND_S) for a in agents]
    finally:
        for a in agents:
            a.kill()
    assert [a.returncode for a in agents] == [0, 0], [err[-3000:] for _, err in outs]
    lines = [json.loads(line) for out, _ in outs for line in out.splitlines() if line.startswith("{")]
    assert [line["token_ids"] for line in lines] == reference  # printed by one node only


def test_killed_worker_ends_the_requests_with_an_error(tiny_pair, tmp_path):
    run = torchrun(FAULT_SCRIPT, "kill-worker", tiny_pair[0], str(tmp_path))
    assert run.returncode != 0  # torchrun reports the killed rank
    report = json.loads((tmp_path / "rank0.json").read_text())
    assert report["finished"] and report["finish_reasons"] == ["error", "error"], report
    assert all("tensor-parallel" in e for e in report["errors"]), report
    assert report["health_error"] is not None


def test_workers_leave_when_the_driver_dies(tiny_pair, tmp_path):
    """Rank 0 is SIGKILLed after a generation: the worker's ``LLM(...)`` call (blocked waiting for the next
    command) raises at once instead of waiting on - and the worker writes what it raised before torchrun's own
    SIGKILL, 30 s after its ignored SIGTERM, would end it."""
    run = torchrun(FAULT_SCRIPT, "kill-driver", tiny_pair[0], str(tmp_path))
    assert run.returncode != 0
    raised = json.loads((tmp_path / "rank1.json").read_text())["raised"]
    assert raised.startswith("TensorParallelError: tensor-parallel rank 1 lost the driver (rank 0)"), raised


@pytest.fixture
def as_torchrun_rank0(monkeypatch):
    """This process made to look like rank 0 of 2 under torchrun; a rendezvous fails the test at once (the
    refusals below come before it)."""
    from specdec.distributed import torchrun as torchrun_module

    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}
    for name, value in env.items():
        monkeypatch.setenv(name, value)

    def no_rendezvous(timeout_s):
        raise AssertionError("a rendezvous was attempted")

    monkeypatch.setattr(torchrun_module, "rendezvous_store", no_rendezvous)
    return torchrun_module


@pytest.mark.parametrize("size", [4])
def test_world_size_other_than_tensor_parallel_size_is_refused(tiny_pair, as_torchrun_rank0, size):
    with pytest.raises(ValueError, match="started by torchrun with WORLD_SIZE=2: .* tensor_parallel_size must be 2"):
        small_llm(tiny_pair[0], dtype="float32", tensor_parallel_size=size, num_kv_blocks=64)


def test_one_process_engines_under_a_torchrun_environment(tiny_pair, as_torchrun_rank0):
    """``tensor_parallel_size=1`` under torchrun's variables (data-parallel replicas, a DDP or SLURM job) is not a
    tensor-parallel launch: a one-process engine, no rendezvous (the fixture fails one), and it decodes."""
    llm = small_llm(tiny_pair[0], dtype="float32", tensor_parallel_size=1, num_kv_blocks=64)
    assert llm.engine.workers is None
    out = llm.generate(["hello"], SamplingParams(temperature=0, max_tokens=3, ignore_eos=True))[0]
    assert len(out.outputs[0].token_ids) == 3


def test_a_second_engine_in_one_launch_is_refused(tiny_pair, as_torchrun_rank0, monkeypatch):
    monkeypatch.setattr(as_torchrun_rank0, "_engine_started", True)  # as after the launch's first engine
    with pytest.raises(RuntimeError, match="one tensor-parallel engine"):
        small_llm(tiny_pair[0], dtype="float32", tensor_parallel_size=2, num_kv_blocks=64)


def test_launch_env_and_the_device_of_each_rank():
    """torchrun's five variables make a launch (none, or not all: no launch); rank r uses cuda:LOCAL_RANK, and a
    LOCAL_RANK without a CUDA device on its node is refused."""
    import torch

    from specdec.distributed.launch_env import LaunchEnv, check_launch

    local = torch.cuda.device_count()  # one past this node's last device
    environ = {"RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": str(local), "MASTER_ADDR": "h", "MASTER_PORT": "29400"}
    assert LaunchEnv.from_environ({}) is None
    assert LaunchEnv.from_environ({k: v for k, v in environ.items() if k != "MASTER_PORT"}) is None
    env = LaunchEnv.from_environ(environ)
    assert (env.rank, env.world_size, env.is_driver) == (3, 4, False)
    assert env.device("cuda") == torch.device("cuda", local) and env.device("cpu") == torch.device("cpu")
    check_launch(4, torch.device("cpu"), environ)  # fine on CPU
    check_launch(1, torch.device("cpu"), environ)  # one engine per process (replicas): not a tensor-parallel launch
    with pytest.raises(ValueError, match=f"LOCAL_RANK={local} and uses cuda:{local}"):
        check_launch(4, torch.device("cuda"), environ)
    with pytest.raises(ValueError, match="must be integers"):
        LaunchEnv.from_environ({**environ, "RANK": "zero"})
    with pytest.raises(ValueError, match=r"RANK=4 must lie in \[0, WORLD_SIZE=4\)"):
        LaunchEnv.from_environ({**environ, "RANK": "4"})
