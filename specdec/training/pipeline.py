"""``specdec train-draft TARGET OUT/``: prompts -> the target's answers -> draft vocabulary -> target features ->
training-time-test training -> the head in the published layout, in ``OUT/``.

``OUT/`` layout: ``data/`` (``prompts.json``, ``samples.jsonl``, ``vocab.safetensors``, ``features/``),
``checkpoints/``, ``train_log.jsonl``, ``summary.json``, and the head itself (``config.json``,
``model.safetensors``). Every stage skips what an earlier run of the same command already wrote.
"""

from __future__ import annotations

import gc
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from specdec.checkpoint.loader import read_checkpoint_tensor
from specdec.model.eagle3 import Eagle3Config, default_aux_layers
from specdec.training import data, features, vocab
from specdec.training.head import TrainHead
from specdec.training.trainer import LoopConfig, latest_checkpoint, train_loop
from specdec.training.ttt import collate
from specdec.training.writer import head_config_dict, write_head

DEFAULT_MAX_DRAFT_VOCAB = 32000


@dataclass
class TrainDraftConfig:
    """Options of ``train-draft`` (the CLI's flags); ``__post_init__`` raises ``ValueError`` on bad values."""

    target: str
    out_dir: str
    prompts: str | None = None  # JSON-lines / text file; None: the shipped prompt set (unless self_prompts)
    self_prompts: int | None = None  # this many prompts written by the target instead
    max_prompts: int | None = None  # use only the first N prompts
    max_new_tokens: int = 128
    temperature: float = 0.0  # of the target's answers (0: greedy)
    draft_vocab_size: int | None = None  # None: min(V, 32000)
    ttt_steps: int = 5
    epochs: float = 1.0
    steps: int | None = None  # overrides epochs
    batch_size: int = 4
    lr: float = 5e-4
    warmup_steps: int | None = None  # None: 5% of the steps
    grad_clip: float = 0.5
    checkpoint_every: int = 100
    dtype: str = "auto"  # the target's (as LLM(dtype=)); the head trains in fp32 (bf16 autocast on CUDA)
    device: str = "cpu"
    threads: int | None = None
    resume: bool = False
    seed: int = 0
    gen_batch_size: int = 16
    prepack_weights: bool | None = None  # as LLM(prepack_weights=)

    def __post_init__(self):
        if self.prompts is not None and self.self_prompts is not None:
            raise ValueError("give --prompts or --self-prompts, not both")
        for name in ("max_new_tokens", "ttt_steps", "batch_size", "checkpoint_every", "gen_batch_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {getattr(self, name)!r}")
        for name in ("self_prompts", "max_prompts", "steps", "threads", "draft_vocab_size"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value < 1):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {value!r}")
        if not self.epochs > 0:
            raise ValueError(f"--epochs must be > 0, got {self.epochs!r}")
        if not self.lr > 0:
            raise ValueError(f"--lr must be > 0, got {self.lr!r}")
        if self.temperature < 0:
            raise ValueError(f"--temperature must be >= 0, got {self.temperature!r}")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"--device must be cpu or cuda, got {self.device!r}")
        if self.device == "cuda" and not torch.cuda.is_available():
            raise ValueError("--device cuda: no CUDA device is available here")


def train_draft(cfg: TrainDraftConfig) -> dict:
    """Run every stage (skipping what ``cfg.out_dir`` already holds) and write the head; returns the summary
    (data size, timings, final loss and per-step top-1 agreement) also written to ``OUT/summary.json``."""
    import specdec

    if cfg.threads is not None:
        torch.set_num_threads(cfg.threads)
    out = Path(cfg.out_dir)
    data_dir, ckpt_dir = out / "data", out / "checkpoints"
    if latest_checkpoint(ckpt_dir) is not None and not cfg.resume:
        raise ValueError(f"{out} already holds training checkpoints: pass --resume to continue, or choose another "
                         "folder")
    torch.manual_seed(cfg.seed)
    summary: dict = {"config": asdict(cfg)}
    llm = specdec.LLM(cfg.target, dtype=cfg.dtype, device=cfg.device, max_model_len=None,
                      seed=cfg.seed, prepack_weights=cfg.prepack_weights)
    engine = llm.engine
    target_cfg = engine.model.config
    aux_layers = default_aux_layers(target_cfg.num_hidden_layers)

    t0 = time.perf_counter()
    prompts = _prompts(llm, cfg, data_dir)
    samples = data.generate_samples(llm, prompts, data_dir, cfg.max_new_tokens, cfg.temperature,
                                    cfg.gen_batch_size, cfg.seed)
    summary["data"] = {"prompts": len(samples), "answer_tokens": sum(len(s.answer_ids) for s in samples),
                       "tokens": sum(len(s.ids) for s in samples), "generate_seconds": time.perf_counter() - t0}

    d2t, t2d = _vocab(cfg, samples, target_cfg.vocab_size, data_dir)
    summary["data"]["draft_vocab_size"] = int(d2t.numel())
    summary["data"]["draft_vocab_coverage"] = vocab.coverage((s.answer_ids for s in samples), t2d)

    t0 = time.perf_counter()
    feat_dtype = torch.float32 if engine.model.embed_tokens.weight.dtype == torch.float32 else torch.bfloat16
    features.write_features(engine, samples, data_dir / "features", aux_layers, feat_dtype)
    summary["data"]["feature_seconds"] = time.perf_counter() - t0

    device = torch.device(cfg.device)
    draft_ids = torch.arange(d2t.numel()) + d2t
    with torch.no_grad():
        embedding = engine.model.embed_tokens.weight.detach().to(device, torch.float32).clone()  # frozen
        lm_head = engine.model.lm_head.weight
        if lm_head.is_meta:  # released for its prepacked copy (specdec/model/linear.py): read it from the checkpoint
            lm_head = read_checkpoint_tensor(engine.config.model_path, "lm_head.weight")
        lm_rows = lm_head.detach()[draft_ids].to(device, torch.float32).clone()  # (D, H)
        final_norm = engine.model.norm.weight.detach().to(device, torch.float32).clone()
    with open(Path(engine.config.model_path) / "config.json", encoding="utf-8") as f:
        head_raw = head_config_dict(json.load(f), int(d2t.numel()), aux_layers)
    del llm, engine  # the target is no longer needed: its features are on disk
    gc.collect()
    head_cfg = Eagle3Config.from_dict(head_raw)
    longest = max(len(s.ids) for s in samples)
    head = initial_head(head_cfg, lm_rows, final_norm, longest + cfg.ttt_steps + 1, cfg.seed).to(device)

    steps = cfg.steps or math.ceil(cfg.epochs * math.ceil(len(samples) / cfg.batch_size))
    loop = LoopConfig(steps=steps, batch_size=cfg.batch_size, lr=cfg.lr, ttt_steps=cfg.ttt_steps,
                      warmup_steps=cfg.warmup_steps if cfg.warmup_steps is not None else max(1, steps // 20),
                      grad_clip=cfg.grad_clip, checkpoint_every=cfg.checkpoint_every, seed=cfg.seed)

    def make_batch(indices: list[int]):
        items = [(samples[i].ids, len(samples[i].prompt_ids), features.read_features(data_dir / "features", i))
                 for i in indices]
        return collate(items, lm_rows, t2d, torch.float32, device)

    result = train_loop(head, embedding, make_batch, len(samples), loop, ckpt_dir, cfg.resume,
                        log_file=out / "train_log.jsonl")
    write_head(out, head_raw, head.published_state(), d2t, t2d)
    last = result.history[-min(len(result.history), 10):]  # the mean of the last (up to) 10 steps
    summary["train"] = {"steps": result.step, "seconds": result.seconds, "warnings": result.warnings,
                        "final_loss": sum(r["loss"] for r in last) / max(len(last), 1),
                        "final_top1": [sum(r["top1"][j] for r in last) / len(last) for j in range(cfg.ttt_steps)]
                        if last else []}
    with open(out / "summary.json", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2)
    return summary


def initial_head(head_cfg: Eagle3Config, lm_rows: torch.Tensor, final_norm: torch.Tensor, max_positions: int,
                 seed: int) -> TrainHead:
    """The head training starts from (CPU, fp32): ``fc`` and ``midlayer`` random (``nn.Linear``'s init under
    ``seed``, as SpecForge starts), the LM head the target's rows of the draft vocabulary ``lm_rows`` [D, H] and
    the final norm the target's ``final_norm`` [H] (a head whose output resembles the target's last hidden state
    then predicts as the target does)."""
    torch.manual_seed(seed)
    head = TrainHead(head_cfg, max_positions)
    with torch.no_grad():
        head.lm_head.weight.copy_(lm_rows)
        head.norm.weight.copy_(final_norm)
    return head


def _prompts(llm, cfg: TrainDraftConfig, data_dir: Path) -> list[str]:
    """The prompt list, fixed on the first run in ``data/prompts.json`` (a rerun answers the same prompts)."""
    file = data_dir / "prompts.json"
    if file.is_file():
        with open(file, encoding="utf-8") as f:
            return json.load(f)
    if cfg.self_prompts is not None:
        prompts = data.self_prompts(llm, cfg.self_prompts, seed=cfg.seed)
    else:
        prompts = data.read_prompts(cfg.prompts or data.SHIPPED_PROMPTS)
    prompts = prompts[: cfg.max_prompts] if cfg.max_prompts is not None else prompts
    data_dir.mkdir(parents=True, exist_ok=True)
    with open(file, "w", encoding="utf-8") as f:
        json.dump(prompts, f, indent=1)
    return prompts


def _vocab(cfg: TrainDraftConfig, samples, vocab_size: int, data_dir: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """``(d2t, t2d)``, fixed on the first run in ``data/vocab.safetensors`` (checkpoints depend on it)."""
    file = data_dir / "vocab.safetensors"
    if file.is_file():
        saved = load_file(str(file))
        return saved["d2t"], saved["t2d"]
    size = cfg.draft_vocab_size or min(vocab_size, DEFAULT_MAX_DRAFT_VOCAB)
    d2t, t2d = vocab.draft_vocab((s.answer_ids for s in samples), vocab_size, size)
    save_file({"d2t": d2t, "t2d": t2d}, str(file))
    return d2t, t2d
