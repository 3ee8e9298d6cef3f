"""The memory an engine holds is its weights in their running format plus its KV pool (issue 19).

Two measurements, each with the mutant it must reject:
- a census of the tensors alive in the process (every CPU storage counted once, oneDNN-packed weights by their
  bytes) after ``LLM(...)``: weights + pool, not weights twice (a kept plain copy beside the packed one) and not
  the float32 tensors a loader read (a kept full-precision copy);
- the peak resident set of a process that loads a float32 checkpoint into bfloat16: the bf16 model plus one read
  chunk, not the float32 model on the way (a mapped file, or parameters allocated in float32 and converted).
"""

import gc
import json
import os
import subprocess
import sys
import textwrap
import warnings

import pytest
import torch
from helpers import small_llm
from torch._subclasses.fake_tensor import FakeTensor
from torch._subclasses.functional_tensor import FunctionalTensor

from specdec.checkpoint import loader
from specdec.model.linear import prepack_linears, prepack_supported
from tests.tiny_models import make_tiny_model

CPU = torch.device("cpu")
DTYPE = torch.bfloat16 if prepack_supported(torch.bfloat16, CPU) else torch.float32


@pytest.fixture(scope="module")
def small_model(tmp_path_factory) -> str:
    return make_small_model(str(tmp_path_factory.mktemp("footprint_small")))


def make_small_model(path: str) -> str:
    """A qwen2 checkpoint of ~2M parameters with a tied LM head, written to ``path``."""
    make_tiny_model(path, "qwen2", vocab_size=2048, hidden_size=256, num_layers=3, num_heads=4, num_kv_heads=2,
                    intermediate_size=512, tie_word_embeddings=True)
    return path


def live_tensor_bytes() -> int:
    """Bytes of every tensor alive in this process: CPU storages once each, opaque (oneDNN) tensors by nbytes."""
    gc.collect()
    storages: dict[int, int] = {}
    opaque = 0
    with warnings.catch_warnings():  # isinstance() on some deprecated torch objects warns
        warnings.simplefilter("ignore")
        objects = [obj for obj in gc.get_objects() if isinstance(obj, torch.Tensor)]
    for obj in objects:
        if not isinstance(obj, torch.Tensor) or obj.is_meta or obj.device.type != "cpu":
            continue
        if obj.is_mkldnn:
            opaque += obj.nbytes
            continue
        if isinstance(obj, FakeTensor | FunctionalTensor):  # a torch.compile's tracing tensors hold no memory
            continue  # (kernels/philox.py may be compiling in a background thread, started by an earlier test)
        try:
            storage = obj.untyped_storage()
            ptr = storage.data_ptr()
        except RuntimeError:  # another tensor without storage left alive by an earlier test's torch.compile
            continue
        storages[ptr] = max(storages.get(ptr, 0), storage.nbytes())
    return sum(storages.values()) + opaque


def engine_bytes(path: str) -> tuple[int, int, int]:
    """(bytes the engine's creation left alive, its weights' bytes in the running dtype, its KV pool's bytes)."""
    before = live_tensor_bytes()
    llm = small_llm(path, dtype=DTYPE, num_kv_blocks=16, block_size=16, max_model_len=128)
    held = live_tensor_bytes() - before
    model = llm.engine.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())  # meta (released) ones too; tied once
    pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.pool.tensors)
    del llm
    return held, weights, pool


def test_the_engine_holds_its_weights_once_plus_the_pool(small_model):
    held, weights, pool = engine_bytes(small_model)
    # the tied LM head keeps its plain rows for the embedding lookup and adds one packed copy (vocab x hidden)
    tied_copy = 2048 * 256 * torch.empty((), dtype=DTYPE).element_size() if prepack_supported(DTYPE, CPU) else 0
    assert held <= 1.05 * (weights + tied_copy + pool), (held, weights, tied_copy, pool)


@pytest.mark.skipif(not prepack_supported(DTYPE, CPU), reason="no prepacked linears in this torch/CPU")
def test_the_census_rejects_a_kept_plain_copy(small_model, monkeypatch):
    monkeypatch.setattr(loader, "prepack_linears", lambda model, required=False: prepack_linears(
        model, required=True, release_weights=False))
    real_enable = loader.batch_invariant_kernels.enable  # the invariant kernels' packing, where they run
    monkeypatch.setattr(loader.batch_invariant_kernels, "enable",
                        lambda model, release_weights=True: real_enable(model, release_weights=False))
    held, weights, pool = engine_bytes(small_model)
    assert held > 1.5 * (weights + pool)  # the mutant: every linear weight twice


def test_the_census_rejects_a_kept_full_precision_copy(small_model, monkeypatch):
    kept = []
    real = loader.iter_weight_entries

    def keeping(path):
        for name, entry in real(path):
            kept.append(entry.read().float())  # a loader that holds on to what it read
            yield name, entry

    monkeypatch.setattr(loader, "iter_weight_entries", keeping)
    held, weights, pool = engine_bytes(small_model)
    assert held > 1.5 * (weights + pool)


PEAK_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from specdec.checkpoint import loader

    def kib(field):
        for line in open("/proc/self/status"):
            if line.startswith(field + ":"):
                return int(line.split()[1])

    path, dtype, mutant = sys.argv[1], getattr(torch, sys.argv[2]), sys.argv[3]
    real_to = loader.LlamaForCausalLM.to
    if mutant == "mapped":  # the old reader: safetensors.safe_open maps the file, and read pages stay resident
        from safetensors import safe_open

        def mapped(folder):
            with safe_open(loader.safetensors_files(folder)[0], framework="pt") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        loader.iter_weight_entries = mapped
    if mutant == "fp32_then_cast":  # the old loader: parameters allocated in float32, then converted
        loader.LlamaForCausalLM.to = lambda self, *a, **k: self if a == (dtype,) else real_to(self, *a, **k)
    with torch.device("meta"):  # one-time costs of building a model (lazy imports: ~75 MB here) before the baseline
        loader.LlamaForCausalLM(loader.ModelConfig.from_json(path), max_positions=64)
    baseline = kib("VmRSS")
    model = loader.load_model(path, torch.float32 if mutant == "fp32_then_cast" else dtype, torch.device("cpu"), 64,
                              prepack_weights=False)
    if mutant == "fp32_then_cast":
        model = real_to(model, dtype)
    peak = kib("VmHWM")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    print(json.dumps({"baseline_kib": baseline, "peak_kib": peak, "weights": weights}))
""")


@pytest.fixture(scope="module")
def large_fp32_model(tmp_path_factory) -> str:
    """A float32 checkpoint of ~120 MB: large enough that a float32 copy stands out of the process's noise."""
    path = str(tmp_path_factory.mktemp("footprint_large"))
    make_tiny_model(path, "llama", vocab_size=8192, hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                    intermediate_size=1536, with_tokenizer=False)
    return path


def peak_load(path: str, mutant: str = "") -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run([sys.executable, "-c", PEAK_SCRIPT, path, "bfloat16", mutant or "none"], env=env,
                         capture_output=True, text=True, check=True, timeout=300)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_loading_fp32_into_bf16_peaks_at_the_bf16_model_plus_one_chunk(large_fp32_model):
    run = peak_load(large_fp32_model)
    grew = (run["peak_kib"] - run["baseline_kib"]) * 1024
    fp32_bytes = 2 * run["weights"]
    assert run["weights"] > 50e6  # the bf16 model is big enough to measure
    # bf16 parameters + the scratch chunk (<= 64 MiB, and no larger than the largest tensor in fp32: 16 MiB here)
    assert grew < run["weights"] + 16 * 2**20 + 16 * 2**20, (grew, run)
    for name in ("fp32_then_cast", "mapped"):  # a float32 model, or a mapped float32 file, on the way
        mutant = peak_load(large_fp32_model, name)
        assert (mutant["peak_kib"] - mutant["baseline_kib"]) * 1024 > 0.95 * fp32_bytes, (name, mutant)
