"""Shared pieces of the end-to-end benchmarks: models, prompts, machine facts, timing, bandwidth, forward costs.

Nothing here changes the library; the forward-cost probe drives a model through its own ``ModelRunner`` on a
scratch KV pool, so it times exactly the forward the engine runs, without scheduling or sampling.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.model.config import ModelConfig
from specdec.model.llama import LlamaForCausalLM
from specdec.runner.model_runner import ForwardItem, ModelRunner

BENCH_DIR = Path(__file__).resolve().parent
PROMPTS_DIR = BENCH_DIR / "prompts"
RESULTS_DIR = BENCH_DIR / "results"  # tracked: the figures docs/results.md cites (written with --record)
OUT_DIR = BENCH_DIR / "out"  # git-ignored: where a run writes by default
PROMPT_CLASSES = ("code", "json", "copy", "prose")


# --- models ------------------------------------------------------------------------------------------------
def resolve_model(name: str) -> str:
    """A model folder from an alias (``smollm2``, ``qwen-0.5b``, ``qwen-1.5b``) or a path / hub id as given."""
    if name == "smollm2":
        from specdec.checkpoint.default_model import default_model_path

        return str(default_model_path())
    if name in ("qwen-0.5b", "qwen-1.5b"):
        from bench.models import QWEN_DRAFT, QWEN_TARGET, model_dir

        model = QWEN_DRAFT if name == "qwen-0.5b" else QWEN_TARGET
        path = model_dir(model.name, "float32")
        if not (path / "config.json").is_file():
            raise SystemExit(f"{path} is missing: run `python -m bench.models qwen-pair` first")
        return str(path)
    return name


def weight_bytes(model: LlamaForCausalLM) -> int:
    """Bytes of weights one decode step reads: every parameter once (tied ones once), but not the embedding
    table unless it doubles as the LM head (a lookup reads only the rows of the batch's tokens); a quantised linear
    by the bytes its path holds (``QuantizedLinear.held_bytes``)."""
    total = 0
    embed = model.embed_tokens.weight
    tied = model.lm_head.weight is embed
    quantized = [m for m in model.modules() if hasattr(m, "held_bytes")]  # QuantizedLinear: its packed copies
    inside = {id(p) for m in quantized for p in m.parameters()}
    for param in model.parameters():  # each parameter once (tied ones are one object); released ones are meta
        if (param is embed and not tied) or id(param) in inside:
            continue
        total += param.numel() * param.element_size()
    return total + sum(m.held_bytes() for m in quantized)


def kv_bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
    """K and V bytes one context token holds over all layers."""
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim * element


# --- prompts -----------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Prompt:
    cls: str  # prompt class: code | json | copy | prose
    name: str  # file stem
    text: str  # the user message


def load_prompts(classes: list[str], per_class: int | None = None) -> dict[str, list[Prompt]]:
    """The prompt files of each class (``bench/prompts/<class>/*.txt``, in name order), at most ``per_class``."""
    out = {}
    for cls in classes:
        folder = PROMPTS_DIR / cls
        files = sorted(folder.glob("*.txt"))
        if not files:
            available = sorted(p.name for p in PROMPTS_DIR.iterdir() if p.is_dir())
            raise SystemExit(f"no prompts in {folder}; classes available: {available}")
        out[cls] = [Prompt(cls, f.stem, f.read_text(encoding="utf-8").strip()) for f in files[:per_class]]
    return out


def chat_token_ids(tokenizer, text: str) -> list[int]:
    """The user message in the model's chat template, tokenised once by our tokenizer: every engine (ours and
    transformers) gets exactly these ids."""
    return tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": text}], True))


# --- machine and run facts ---------------------------------------------------------------------------------
def cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=BENCH_DIR, capture_output=True, text=True)
        dirty = subprocess.run(["git", "status", "--porcelain"], cwd=BENCH_DIR, capture_output=True, text=True)
        return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "") if out.returncode == 0 else None
    except OSError:
        return None


def machine_info() -> dict:
    """What a result depends on besides the code: machine, load, library versions, threads, date."""
    try:
        import transformers

        tf_version = transformers.__version__
    except ImportError:
        tf_version = None
    return {
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "machine": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_at_start": os.getloadavg(),
        "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "transformers": tf_version,
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "git_commit": git_commit(),
    }


# what bench.projection.speculative's roofline needs of a model's config.json (the weights a decode forward streams)
SIZE_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
             "intermediate_size", "vocab_size", "tie_word_embeddings")  # fmt: skip


def model_sizes(path: str | None) -> dict | None:
    """The ``SIZE_KEYS`` of the model folder's ``config.json`` (None without a path or a readable file): recorded
    in a result's meta so the result carries the sizes it was measured with, whatever is cached later."""
    if not path:
        return None
    try:
        config = json.loads((Path(path) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    return {key: config[key] for key in SIZE_KEYS if key in config}


def set_threads(threads: int) -> None:
    """One thread count for every engine in the run (torch intra-op; inter-op too where torch still allows)."""
    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(threads)
    except RuntimeError:  # only settable before the first parallel work
        pass


def warm_up_sampling() -> None:
    """Finish compiling the CPU Philox noise (kernels/philox.py) before anything is timed: the engine compiles it in
    a background thread on the first sampled step and draws the same numbers eagerly meanwhile, which would time
    the eager path (and a compiler competing for the cores) instead of the one a long-running process uses."""
    from specdec.kernels import philox

    philox.warm_up_cpu_noise(wait=True)


# --- timing ------------------------------------------------------------------------------------------------
def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


CLOCKS = {"wall": time.perf_counter, "cpu": time.process_time}
_clock = time.perf_counter


def set_clock(name: str) -> None:
    """What ``timed`` measures: "wall" (default) or "cpu" - the process's CPU time, which other processes on a
    shared machine do not move (with one torch thread it is the forward's own time; with several it sums them)."""
    global _clock
    _clock = CLOCKS[name]


def timed(fn: Callable[[], object]) -> tuple[float, object]:
    start = _clock()
    result = fn()
    return _clock() - start, result


def copy_bandwidth(megabytes: int = 256, reps: int = 5) -> dict:
    """Memory bandwidth with the current thread count, in GB/s (1e9 bytes per second), median of ``reps``:
    ``copy`` clones a large fp32 tensor and counts its bytes twice (read + write, as STREAM's copy does);
    ``read`` sums it (reads only)."""
    src = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch the pages before timing
    nbytes = src.numel() * 4
    copies, reads = [], []
    for _ in range(reps):
        copies.append(timed(lambda: dst.copy_(src))[0])
        reads.append(timed(lambda: src.sum())[0])
    return {"buffer_mb": megabytes, "copy_GBps": 2 * nbytes / median(copies) / 1e9,
            "read_GBps": nbytes / median(reads) / 1e9}


def forward_seconds(model: LlamaForCausalLM, config: ModelConfig, batch: int, context: int, new_tokens: int,
                    reps: int = 5, block_size: int = 16) -> float:
    """Median seconds of one forward of ``model`` (the engine's ModelRunner path) over ``batch`` sequences that
    each have ``context`` tokens cached and feed ``new_tokens`` new ones, asking logits for all new tokens (a
    verification window; ``new_tokens=1`` is a decode step). Runs on a scratch pool; the cache holds zeros."""
    param = next(model.parameters())
    total = context + new_tokens
    blocks_per_seq = -(-total // block_size)
    pool = KVPool(config, batch * blocks_per_seq, block_size, param.dtype, param.device)
    manager = BlockManager(batch * blocks_per_seq, block_size)
    runner = ModelRunner(model, pool, manager, param.device)
    gen = torch.Generator().manual_seed(0)
    items = []
    for seq_id in range(batch):
        manager.allocate(seq_id, total)
        tokens = torch.randint(0, config.vocab_size, (new_tokens,), generator=gen).tolist()
        items.append(ForwardItem(seq_id, tokens, context, new_tokens))
    runner.forward(items)  # warm-up
    samples = []
    for _ in range(reps):
        samples.append(timed(lambda: runner.forward(items))[0])
    return median(samples)


# --- output ------------------------------------------------------------------------------------------------
def results_dir(record: bool = False) -> Path:
    """Where a benchmark writes its results: ``bench/out/`` (git-ignored) by default, the tracked
    ``bench/results/`` only when the run is meant to be recorded (``--record``)."""
    return RESULTS_DIR if record else OUT_DIR


def add_record_flag(parser: argparse.ArgumentParser) -> None:
    """The ``--record`` option every benchmark takes (see ``results_dir``)."""
    parser.add_argument("--record", action="store_true",
                        help="write into the tracked bench/results/ (default: the git-ignored bench/out/)")


def write_json(name: str, payload: dict, record: bool = False) -> Path:
    """Write ``<name>.json`` into ``results_dir(record)``; returns its path."""
    folder = results_dir(record)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    return path


def slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in text).strip("_")


def print_table(rows: list[list], header: list[str]) -> None:
    cells = [[_fmt(v) for v in row] for row in [header, *rows]]
    widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
    for i, row in enumerate(cells):
        print("  ".join(c.rjust(w) for c, w in zip(row, widths)))
        if i == 0:
            print("  ".join("-" * w for w in widths))


def _fmt(value) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3f}" if abs(value) < 10 else f"{value:.1f}"
    return str(value)
