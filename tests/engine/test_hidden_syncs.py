"""No hidden host syncs on the step path, checked on CPU.

On CUDA a step must not make the host wait for the device except at its one host read (``StepOutput.read``). Three
constructs wait without looking like a read, and ``tests/engine/test_host_syncs.py`` (which counts ``.item()`` /
``.tolist()``) cannot see them:

- indexing a tensor with a Python list or a numpy array (``logits[rows]``, ``x[rows] = v``): the index is copied
  host-to-device through pageable memory first, a blocking copy;
- building a tensor from Python data (``torch.tensor(list, device=...)``, ``torch.as_tensor``): the same;
- moving a pageable CPU tensor to a device (``t.to(device)``): the same.

Every index and every small tensor a step sends to the device must go through ``specdec.device.to_device``
(pinned memory, non-blocking) or the runner's staging buffer. This test runs whole engine steps - plain, chains
greedy and sampled, block verification, static and dynamic trees, a model-free proposer, a combined proposer,
penalties, logprobs, a prefill admitted beside verification rounds, EAGLE-3 chains and trees (the target's hidden
states captured and handed over) - under a ``TorchFunctionMode`` that records
each such construct made by ``specdec/`` code outside ``specdec/device.py`` (the torch references of
``kernels/`` are CPU-only code and are left out: on CUDA the kernels run instead).

Checked to fail on the code before the round-as-data refactor: there every speculative step with a plain row
beside it indexed the logits with Python lists (``engine/step.py``: ``logits[plain_rows]``, ``logits[spec_rows]``)
and every tree-masked forward built its mask offsets with ``torch.tensor(..., device=...)``.
"""

from __future__ import annotations

import os
import sys
import traceback

import numpy as np
import pytest
import torch
from helpers import small_llm
from torch.overrides import TorchFunctionMode

import specdec
from specdec import SamplingParams, SpeculativeConfig

REPO = os.path.dirname(os.path.dirname(os.path.abspath(specdec.__file__)))
SPECDEC = os.path.join(REPO, "specdec")
ALLOWED = os.path.join(SPECDEC, "device.py")  # to_device: the one sanctioned way onto the device


def _engine_frame() -> str | None:
    """'file:line' of the innermost frame in ``specdec/`` when it is the innermost frame of this repository (and
    not ``specdec/device.py``); None otherwise."""
    for frame in reversed(traceback.extract_stack(sys._getframe(2))):
        path = os.path.abspath(frame.filename)
        if path.startswith(REPO + os.sep) and not path.startswith(os.path.join(REPO, "tests")):
            if path == ALLOWED or not path.startswith(SPECDEC + os.sep):
                return None  # to_device, or a kernel's torch reference
            return f"{os.path.relpath(path, REPO)}:{frame.lineno}"
    return None


def _host_index(index) -> bool:
    """An index that lives on the host (a list, a numpy array, or a tuple holding one)."""
    if isinstance(index, tuple):
        return any(_host_index(i) for i in index)
    return isinstance(index, (list, np.ndarray))


class HiddenSyncs(TorchFunctionMode):
    """Records (construct, where) for every hidden-sync construct made by ``specdec/`` code."""

    def __init__(self):
        super().__init__()
        self.found: list[tuple[str, str]] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        construct = None
        if func in (torch.Tensor.__getitem__, torch.Tensor.__setitem__) and _host_index(args[1]):
            construct = f"tensor indexed with a host {type(args[1]).__name__}"
        elif func in (torch.tensor, torch.as_tensor):
            construct = f"{func.__name__}(...) from Python data"
        elif func is torch.Tensor.to and _moves_pageable(args, kwargs):
            construct = "pageable CPU tensor .to(device)"
        if construct is not None:
            where = _engine_frame()
            if where is not None:
                self.found.append((construct, where))
        return func(*args, **kwargs)


def _moves_pageable(args, kwargs) -> bool:
    """``Tensor.to`` with a device argument, from an unpinned CPU tensor."""
    tensor = args[0]
    targets = [a for a in args[1:] if isinstance(a, (torch.device, str))] + (
        [kwargs["device"]] if "device" in kwargs else [])
    return bool(targets) and tensor.device.type == "cpu" and not tensor.is_pinned()


GREEDY = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=40, ignore_eos=True, seed=5)
PENALISED = SamplingParams(temperature=0.7, repetition_penalty=1.2, frequency_penalty=0.3, max_tokens=40,
                           ignore_eos=True, seed=6, logprobs=2)


@pytest.fixture(scope="module")
def eagle_head(tiny_pair, tmp_path_factory) -> str:
    """An EAGLE-3 head (a smaller draft vocabulary) for ``tiny_pair``'s two-layer target."""
    from tiny_models import make_tiny_eagle3_head

    path = str(tmp_path_factory.mktemp("syncs_eagle3"))
    make_tiny_eagle3_head(path, tiny_pair[0], seed=6, aux_layer_ids=[0, 1, 2], draft_ids=list(range(0, 300, 2)))
    return path


def _configs(draft: str, eagle_head: str) -> dict[str, SpeculativeConfig | None]:
    model = dict(method="draft_model", draft_model=draft, num_speculative_tokens=3)
    eagle = dict(method="eagle3", draft_model=eagle_head, num_speculative_tokens=3)
    return {
        "eagle3_chain": SpeculativeConfig(**eagle),
        "eagle3_tree_static": SpeculativeConfig(**eagle, tree_policy="always", tree=[2, 1, 1]),
        "eagle3_tree_dynamic": SpeculativeConfig(**eagle, tree_policy="always", tree="dynamic", tree_budget=6),
        "plain": None,
        "chain": SpeculativeConfig(**model),
        "chain_block": SpeculativeConfig(**model, verify="block"),
        "tree_static": SpeculativeConfig(**model, tree_policy="always", tree=[2, 1, 1]),
        "tree_dynamic": SpeculativeConfig(**model, tree_policy="always", tree="dynamic", tree_budget=6),
        "prompt_lookup": SpeculativeConfig(method="prompt_lookup", num_speculative_tokens=3, prompt_lookup_min=1),
        "combined": SpeculativeConfig(method="combined", draft_model=draft, num_speculative_tokens=3,
                                      prompt_lookup_min=1),
    }


@pytest.mark.parametrize("params", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "sampled", "penalties_logprobs"])
@pytest.mark.parametrize("mode", ["plain", "chain", "chain_block", "tree_static", "tree_dynamic", "prompt_lookup",
                                  "combined", "eagle3_chain", "eagle3_tree_static", "eagle3_tree_dynamic"])
def test_engine_steps_make_no_hidden_sync(tiny_pair, eagle_head, mode, params):
    target, draft = tiny_pair
    llm = small_llm(target, dtype="float32", block_size=4, max_model_len=128, max_num_seqs=4, num_kv_blocks=200,
                      speculative=_configs(draft, eagle_head)[mode])
    engine = llm.engine
    for i in range(3):
        engine.add_request(prompt_token_ids=[5 + i, 6, 7, 8, 5 + i, 6, 7], params=params)
    for _ in range(2):  # prefill and a first round: the requests decode (and draft) from here on
        engine.step()
    guard = HiddenSyncs()
    steps = 0
    with guard:
        for step in range(6):
            if step == 2:  # a prefill in the same step as the decodes / verification rounds
                engine.add_request(prompt_token_ids=[9, 10, 11, 9, 10], params=params)
            outputs = engine.step()
            assert all(o.error is None for o in outputs), [o.error for o in outputs]
            steps += 1
    assert steps == 6
    # penalties keep a sampled text from repeating itself, so prompt lookup may find nothing to draft there (the
    # draft-model modes cover verification with penalties)
    if mode != "plain" and not (mode == "prompt_lookup" and params is PENALISED):
        assert sum(s.metrics.num_rounds for s in engine.scheduler.running) > 0, "no round was verified"
    assert not guard.found, "hidden host syncs on the step path:\n" + "\n".join(
        f"  {construct} at {where}" for construct, where in sorted(set(guard.found)))


def test_the_guard_sees_each_construct():
    """Each construct is recorded when ``specdec/`` code makes it (here: code compiled as if in specdec/)."""
    code = compile("x = torch.zeros(4)\n"
                   "x[[0, 1]]\n"
                   "x[np.array([2])] = 1.0\n"
                   "torch.tensor([1, 2])\n"
                   "torch.zeros(2).to('cpu')\n"
                   "x[1:3]\n"
                   "x[torch.tensor([0])]\n",  # a tensor index is fine; its construction is the one recorded
                   os.path.join(SPECDEC, "planted.py"), "exec")
    guard = HiddenSyncs()
    with guard:
        exec(code, {"torch": torch, "np": np})
    constructs = [c for c, _ in guard.found]
    assert constructs == ["tensor indexed with a host list", "tensor indexed with a host ndarray",
                          "tensor(...) from Python data", "pageable CPU tensor .to(device)",
                          "tensor(...) from Python data"], guard.found
    assert all(where.startswith("specdec/planted.py:") for _, where in guard.found)
