"""Memory footprint of an engine: resident set after loading and at its peak, against the bytes of its weights in
their running format and its KV pool; load time and plain decode speed beside them.

    python -m bench.memory.footprint --models smollm2 qwen-0.5b qwen-1.5b --dtypes float32 bfloat16 [--python OTHER]
    python -m bench.memory.footprint --models smollm2 --dtypes bfloat16 --quantizations none int8 int4

Every (model, dtype) runs in a fresh process (max RSS is per process): the engine is built with
``specdec.LLM(model, dtype=...)`` (prepacked linears where supported, the default), one short prompt is decoded
greedily, and the process reports VmRSS before loading (torch and specdec imported), after, and VmHWM (peak).
``--python`` runs the same measurement with another tree's interpreter (old vs new, alternated per model).
``--quantizations``: ``LLM(quantization=...)`` values ("none" = unquantised); held weights then count each
quantised linear's packed copies (``QuantizedLinear.held_bytes``).

``--random-7b DIR``: also measure a random-weight 7B-shaped Llama (``RANDOM_7B``: Llama-3-8B's layers with a 32000
vocabulary and an untied head, ~7.2B parameters, ~14.5 GB in bf16), written to DIR first if DIR has no
``config.json`` - sharded safetensors (~2 GB files and an index), drawn one shard at a time
(``bench/gpu_steps/models.py``). Delete DIR yourself afterwards.

    python -m bench.memory.footprint --random-7b /tmp/random-7b --dtypes bfloat16 --quantizations none int8 --tokens 8
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from bench.common import add_record_flag, machine_info, print_table, resolve_model, write_json

CHILD = r"""
import json, sys, time
import torch
torch.set_num_threads(int(sys.argv[3]))
import specdec

def mib(field):
    for line in open("/proc/self/status"):
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024

path, dtype, tokens = sys.argv[1], sys.argv[2], int(sys.argv[4])
quantization = sys.argv[5] if len(sys.argv) > 5 and sys.argv[5] != "none" else None
quantize_lm_head = None
if quantization is not None and quantization.endswith("+head"):  # "int4+head": LLM(quantize_lm_head=True)
    quantization, quantize_lm_head = quantization.removesuffix("+head"), True
before = mib("VmRSS")
start = time.perf_counter()
options = {"quantization": quantization} if quantization else {}
if quantize_lm_head:  # only when asked: an older tree (--python) has no such argument
    options["quantize_lm_head"] = True
llm = specdec.LLM(path, dtype=dtype, max_model_len=512, **options)
load_s = time.perf_counter() - start
after = mib("VmRSS")
model = llm.engine.model
params = sum(p.numel() * p.element_size() for p in model.parameters())
packed = sum(getattr(m, "packed_copy").nbytes for m in model.modules()
             if getattr(m, "packed_copy", None) is not None)
released = sum(p.numel() * p.element_size() for p in model.parameters() if p.is_meta)
quantized = [m for m in model.modules() if hasattr(m, "held_bytes")]
inside = {id(p) for m in quantized for p in m.parameters()}
params = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in inside)
quant_bytes = sum(m.held_bytes() for m in quantized)
pool = sum(t.numel() * t.element_size() for t in llm.engine.runner.pool.tensors)
sp = specdec.SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=4))
start = time.perf_counter()
llm.generate(prompt_token_ids=[[1, 2, 3, 4]], sampling_params=sp)
decode = tokens / (time.perf_counter() - start)
print(json.dumps({"rss_before_mib": before, "rss_after_mib": after, "peak_mib": mib("VmHWM"), "load_s": load_s,
                  "param_mib": params / 2**20,
                  "held_weights_mib": (params - released + packed + quant_bytes) / 2**20, "pool_mib": pool / 2**20,
                  "quantized_linears": len(quantized), "quant_counts": getattr(model, "quant_counts", None),
                  "decode_tok_s": decode, "dtype": str(next(p for p in model.parameters()).dtype)}))
"""


RANDOM_7B = dict(hidden_size=4096, num_layers=32, num_heads=32, num_kv_heads=8, intermediate_size=14336,
                 vocab_size=32000, tie_word_embeddings=False)  # fmt: skip
RANDOM_7B_SHARD_BYTES = 2 * 10**9


def random_7b(path: str, shape: dict | None = None) -> str:
    """``path``, after writing the random bf16 checkpoint of ``shape`` (default ``RANDOM_7B``) there unless it already
    has a config.json."""
    shape = shape or RANDOM_7B
    if not (Path(path) / "config.json").is_file():
        from bench.gpu_steps.models import write_random_llama

        print(f"writing a random checkpoint to {path} ({shape})", flush=True)
        write_random_llama(path, **shape, device="cpu", shard_bytes=RANDOM_7B_SHARD_BYTES)
    return path


def measure(python: str, path: str, dtype: str, threads: int, tokens: int, quantization: str = "none") -> dict:
    # cwd outside any tree: with -c the working directory comes first on sys.path and would shadow the
    # interpreter's own (editable) specdec - an "old" interpreter run from here would import this tree's code
    out = subprocess.run([python, "-c", CHILD, path, dtype, str(threads), str(tokens), quantization],
                         capture_output=True, text=True, check=False, cwd=tempfile.gettempdir())
    if out.returncode != 0:  # a negative code is a signal: -9, SIGKILL, is what the OOM killer sends
        return {"error": (out.stderr or out.stdout).strip().splitlines()[-1:], "returncode": out.returncode}
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.memory.footprint", description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=None,
                        help="folders or smollm2 | qwen-0.5b | qwen-1.5b (default: smollm2 unless --random-7b)")
    parser.add_argument("--random-7b", default=None, metavar="DIR",
                        help="also measure a random 7B-shaped bf16 Llama, written to DIR first if it is not there")
    parser.add_argument("--dtypes", nargs="+", default=["auto"], help="LLM(dtype=...) values")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32, help="greedy tokens decoded after a warm-up")
    parser.add_argument("--quantizations", nargs="+", default=["none"], help="none | int8 | int4 (LLM(quantization=)); "
                        "int8+head / int4+head: with LLM(quantize_lm_head=True)")
    parser.add_argument("--python", default=None, help="also run with this interpreter (another tree: old vs new)")
    add_record_flag(parser)
    args = parser.parse_args(argv)
    interpreters = {"new": sys.executable, **({"old": args.python} if args.python else {})}
    models = {name: resolve_model(name) for name in args.models or ([] if args.random_7b else ["smollm2"])}
    if args.random_7b:
        models["random-7b"] = random_7b(args.random_7b)
    rows, results = [], []
    for name, path in models.items():
        for dtype, quant in ((d, q) for d in args.dtypes for q in args.quantizations):
            for label, python in interpreters.items():
                r = {"model": name, "dtype_asked": dtype, "quantization": quant, "tree": label,
                     **measure(python, path, dtype, args.threads, args.tokens, quant)}
                results.append(r)
                print(json.dumps(r), flush=True)
                if "error" in r:
                    continue
                grew = r["rss_after_mib"] - r["rss_before_mib"]
                rows.append([name, dtype, quant, label, r["dtype"].removeprefix("torch."),
                             round(r["held_weights_mib"]),
                             round(r["pool_mib"]), round(r["rss_after_mib"]), round(grew),
                             round(grew / (r["held_weights_mib"] + r["pool_mib"]), 2), round(r["peak_mib"]),
                             round(r["load_s"], 1), round(r["decode_tok_s"], 2)])
    print_table(rows, ["model", "dtype", "quant", "tree", "runs in", "held weights MiB", "pool MiB", "RSS MiB",
                       "RSS grew", "grew/(held+pool)", "peak MiB", "load s", "decode tok/s"])
    meta = {**machine_info(), "threads": args.threads, "tokens": args.tokens,
            **({"random_7b_shape": RANDOM_7B} if args.random_7b else {})}
    write_json("footprint", {"meta": meta,
                             "results": results}, args.record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
