"""End-to-end speculative decoding: tokens/s per prompt class, target-only vs speculative, vs transformers.

    python -m bench.speed.e2e --target smollm2 --method prompt_lookup [--adaptive] --k 4 --temperature 0 --batch 1
    python -m bench.speed.e2e --target qwen-1.5b --draft qwen-0.5b --method draft_model --k 4 --batch 1
    python -m bench.speed.e2e --target qwen-1.5b --draft qwen-0.5b --method draft_model --temperature 0.8 --verify block

For each prompt class in ``bench/prompts/`` (code, json, copy, prose; a few prompt files each) and each batch
size, in one process with one thread count:

Phase A  our target-only engine (``speculative=None``) vs our speculative engine, interleaved (the order
         alternates every repetition): tokens/s (generated tokens / wall time of ``generate``, prefill
         included; stop at EOS or --max-tokens), speedup, and from ``RequestOutput.metrics``: acceptance_rate,
         alpha, tau (mean tokens per round), per-position acceptance, the share of decode steps that verified a
         draft, the mean draft length. At temperature 0 the two engines' tokens must be identical (lossless).
         Beside the measured speedup, two predictions from the measured alpha:
           Theorem 3.8 (Leviathan et al.)  (1 - a^(k+1)) / ((1 - a) (k c + 1))
           with verification cost          (1 - a^(k+1)) / ((1 - a) (k c + v(k)))
         c = draft forward / target forward (one token per request at batch B; 0 for model-free methods) and
         v(k) = target forward of k+1 tokens per request / of 1 token, both timed here on the engine's own
         forward at the class's mean context length. Both assume every step drafts k tokens; a third column,
         "mix", predicts from what the run did: a share f of decode steps verified a draft of mean length
         k_bar and emitted tau tokens, the rest were plain steps: (f tau + 1 - f) / (f (k_bar c + v(k_bar)) + 1 - f).
         The gap between "mix" and the measured speedup is time the forward-cost model does not see (drafting
         on the CPU, verification, bookkeeping).
Phase B  (batch 1 only: transformers' assisted generation and prompt lookup support nothing else) our
         speculative engine vs transformers on the same weights, prompts and threads, interleaved:
         ``assistant_model=`` for draft_model / combined, ``prompt_lookup_num_tokens=k`` for ngram /
         prompt_lookup. Reported as ours / transformers tokens/s.

Batch sizes above 1 cycle the class's prompts to fill the batch and submit them in one ``generate`` call.
Results: ``bench/out/e2e_<target>[_<draft>]_<method>[_adaptive]_k<k>_b<batches>_T<temp>_t<threads>.json``
and a ``.png`` of the speedups (if matplotlib is importable: ``pip install matplotlib``, a bench-only
dependency); with ``--record``, in the tracked ``bench/results/`` instead.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import sys
from pathlib import Path

import torch

import specdec
from bench.common import (
    PROMPT_CLASSES,
    add_record_flag,
    chat_token_ids,
    forward_seconds,
    load_prompts,
    machine_info,
    median,
    model_sizes,
    print_table,
    resolve_model,
    set_clock,
    set_threads,
    slug,
    timed,
    warm_up_sampling,
    write_json,
)
from specdec.config import SPECULATIVE_METHODS, VERIFY_METHODS, parse_tree
from specdec.tokenizer.tokenizer import Tokenizer


# --- engines -----------------------------------------------------------------------------------------------
class Ours:
    """One of our LLMs; ``run`` is one generate call over a list of prompts."""

    def __init__(self, llm: specdec.LLM, params: specdec.SamplingParams):
        self.llm, self.params = llm, params

    def run(self, prompts: list[list[int]]) -> dict:
        seconds, outs = timed(lambda: self.llm.generate(prompt_token_ids=prompts, sampling_params=self.params))
        return {"seconds": seconds, "tokens": [o.outputs[0].token_ids for o in outs],
                "metrics": [o.metrics for o in outs]}


class Transformers:
    """transformers' generate with assisted generation or prompt lookup; batch 1 only."""

    def __init__(self, model, assistant, method: str, k: int, adaptive: bool, temperature: float, max_tokens: int,
                 eos: list[int], seed: int):
        self.model, self.seed = model, seed
        self.kwargs = {"max_new_tokens": max_tokens, "eos_token_id": eos, "pad_token_id": eos[0]}
        if temperature > 0:
            self.kwargs.update(do_sample=True, temperature=temperature, top_k=0, top_p=1.0)
        else:
            self.kwargs.update(do_sample=False)
        if assistant is not None:
            # k drafts per round; constant unless --adaptive, where transformers' own schedule (+2 after an
            # all-accepted round, -1 otherwise, reset per call) and confidence stop stand in for our adaptive k
            config = assistant.generation_config
            config.num_assistant_tokens = k
            config.num_assistant_tokens_schedule = "heuristic_transient" if adaptive else "constant"
            config.assistant_confidence_threshold = 0.4 if adaptive else 0.0
            self.kwargs["assistant_model"] = assistant
        else:
            self.kwargs.update(prompt_lookup_num_tokens=k, max_matching_ngram_size=4)
        self.description = (f"assisted generation, num_assistant_tokens={k}, schedule "
                            f"{config.num_assistant_tokens_schedule}, confidence threshold "
                            f"{config.assistant_confidence_threshold}" if assistant is not None
                            else f"prompt lookup, prompt_lookup_num_tokens={k}, max_matching_ngram_size=4")

    def run(self, prompts: list[list[int]]) -> dict:
        assert len(prompts) == 1, "transformers' assisted generation and prompt lookup support batch size 1 only"
        ids = torch.tensor(prompts)
        torch.manual_seed(self.seed)
        seconds, out = timed(lambda: self.model.generate(ids, attention_mask=torch.ones_like(ids), **self.kwargs))
        return {"seconds": seconds, "tokens": [out[0, ids.shape[1]:].tolist()]}


def interleave(engines: dict, prompts: list[list[int]], reps: int) -> dict[str, list[dict]]:
    """``reps`` runs of every engine on ``prompts``, alternating the order each repetition."""
    runs = {name: [] for name in engines}
    for rep in range(reps):
        for name in (list(engines) if rep % 2 == 0 else list(reversed(engines))):
            runs[name].append(engines[name].run(prompts))
    return runs


def rate(runs: list[dict]) -> tuple[int, float]:
    """(tokens generated per run, median seconds)."""
    return sum(len(t) for t in runs[-1]["tokens"]), median([r["seconds"] for r in runs])


# --- metrics -----------------------------------------------------------------------------------------------
def aggregate_metrics(metrics: list[dict]) -> dict:
    """Sum the per-request counters of ``metrics`` and recompute the rates over all of them.

    RequestOutput.metrics has rates, not the per-position counts, so per-position acceptance is the mean of the
    requests' rates weighted by their rounds (exact when every round drafts the same number of tokens)."""
    drafted = accepted = rounds = rejected = steps = 0
    round_tokens = 0.0
    positions: dict[int, list[float]] = {}
    k_sum = 0
    for m in metrics:
        n = m["num_rounds"]
        drafted, accepted, rounds = drafted + m["drafted"], accepted + m["accepted"], rounds + n
        if m["alpha"] is not None:  # rounds ending in a rejection, recovered from alpha = a / (a + r)
            rejected += n if m["alpha"] == 0 else round(m["accepted"] / m["alpha"] - m["accepted"])
        round_tokens += (m["mean_tokens_per_round"] or 0.0) * n
        for i, p in enumerate(m["per_position_acceptance"]):
            positions.setdefault(i, [0.0, 0.0])
            positions[i][0] += p * n
            positions[i][1] += n
        steps += len(m["k_per_step"])
        k_sum += sum(m["k_per_step"])
    return {
        "requests": len(metrics),
        "drafted": drafted,
        "accepted": accepted,
        "rounds": rounds,
        "acceptance_rate": accepted / drafted if drafted else None,
        "alpha": accepted / (accepted + rejected) if accepted + rejected else None,
        "tau": round_tokens / rounds if rounds else None,
        "per_position_acceptance": [s / w if w else None for s, w in (positions[i] for i in sorted(positions))],
        "speculating_step_fraction": rounds / steps if steps else None,  # decode steps that verified a draft
        "mean_draft_length": drafted / rounds if rounds else None,
        "mean_k_granted": k_sum / steps if steps else None,
    }


def improvement(alpha: float | None, k: int, c: float, verify: float = 1.0) -> float | None:
    """Theorem 3.8's expected improvement factor, with the target's verification cost v(k) (1 in the theorem)."""
    if alpha is None:
        return None
    tokens = k + 1 if alpha >= 1 else (1 - alpha ** (k + 1)) / (1 - alpha)
    return tokens / (k * c + verify)


def round_mix(row: dict, k: int, c: float, verify: list[float]) -> float | None:
    """The speedup the measured round mix predicts: a share f of decode steps verified a draft of mean length
    k_bar and emitted tau tokens at cost k_bar c + v(k_bar); the rest were plain steps (1 token, cost 1)."""
    f, tau, k_bar = row["speculating_step_fraction"], row["tau"], row["mean_draft_length"]
    if f is None or tau is None:
        return 1.0 if f == 0 else None
    low = min(int(k_bar), k - 1)  # v(j) for j = 1..k is verify[j - 1]; interpolate between neighbours
    frac = k_bar - low
    v_low = 1.0 if low == 0 else verify[low - 1]
    v_bar = v_low + frac * (verify[low] - v_low)
    return (f * tau + 1 - f) / (f * (k_bar * c + v_bar) + 1 - f)


def eagle3_step_seconds(head, batch: int, context: int, reps: int = 3, block_size: int = 16) -> float:
    """Median seconds of one EAGLE-3 draft step (the head's one-layer forward and LM head over one new token per
    sequence, ``context`` tokens cached) at batch size ``batch``, on a scratch pool of the head's own layer."""
    from specdec.cache.block_manager import BlockManager
    from specdec.cache.kv_pool import KVPool
    from specdec.runner.model_runner import ForwardItem, ModelRunner

    config = head.config.layer
    param = next(p for p in head.parameters() if not p.is_meta)
    total, blocks = context + 1, -(-(context + 1) // block_size)
    pool = KVPool(config, batch * blocks, block_size, param.dtype, param.device)
    manager = BlockManager(batch * blocks, block_size)
    runner = ModelRunner(head, pool, manager, param.device)
    items = []
    for seq_id in range(batch):
        manager.allocate(seq_id, total)
        items.append(ForwardItem(seq_id, [1], context, 1))
    hidden = torch.zeros(batch, config.hidden_size, dtype=param.dtype, device=param.device)

    def step():
        meta, ids, positions, logits_indices = runner.prepare(items)
        return head(ids, positions, hidden, pool.tensors, meta, logits_indices)

    step()  # warm-up
    return median([timed(step)[0] for _ in range(reps)])


def draft_step_model(llm: specdec.LLM):
    """(draft model, its config, EAGLE-3 head) of a speculative engine, for ``measure_costs``: model-free drafters
    give (None, None, None) - c = 0."""
    proposer = llm.engine.speculative.proposer
    head = getattr(proposer, "head", None)  # an EAGLE-3 head (its Proposer.draft_model is None)
    if head is not None:
        return None, None, head
    drafter = proposer.draft_model  # the draft model (alone or inside a combined proposer), or None
    runner = getattr(drafter, "runner", None)
    return (runner.model, drafter.config, None) if runner is not None else (None, None, None)


def measure_costs(target, draft, config, draft_config, batch: int, context: int, k: int, reps: int = 3,
                  eagle3_head=None) -> dict:
    """c and v(j), j = 1..k, at batch size ``batch`` from timed forwards of the engine's own models (c of an
    EAGLE-3 head: one head step, ``eagle3_step_seconds``, over a target decode)."""
    one = forward_seconds(target, config, batch, context, 1, reps)
    windows = [forward_seconds(target, config, batch, context, j + 1, reps) for j in range(1, k + 1)]
    if eagle3_head is not None:
        draft_one = eagle3_step_seconds(eagle3_head, batch, context, reps)
    else:
        draft_one = forward_seconds(draft, draft_config, batch, context, 1, reps) if draft is not None else None
    return {"context": context, "target_1_ms": 1e3 * one, "target_j_plus_1_ms": [1e3 * w for w in windows],
            "draft_1_ms": 1e3 * draft_one if draft_one is not None else None,
            "c": draft_one / one if draft_one is not None else 0.0, "v": [w / one for w in windows],
            "v_k": windows[-1] / one}


# --- the benchmark -----------------------------------------------------------------------------------------
@contextlib.contextmanager
def reuse_target_weights(llm: specdec.LLM):
    """While open, a new LLM gets ``llm``'s target model instead of loading the same weights again (the engine's
    ``load_model``; the draft model loads normally). The forward is stateless - the KV cache lives in each
    engine's pool - and the two engines never run at once, so sharing is exact and halves the memory."""
    import specdec.engine.engine as engine_module

    original = engine_module.load_model
    engine_module.load_model = lambda *args, **kwargs: llm.engine.model
    try:
        yield
    finally:
        engine_module.load_model = original


@contextlib.contextmanager
def share_draft_weights():
    """While open, draft models are loaded once per (folder, dtype, quantisation): a second engine drafting with
    the same model gets the first one's (``specdec/spec_decode/proposers/factory.py``'s ``load_model``). Exact for
    the same reason as :func:`reuse_target_weights`: each engine keeps its own draft KV pool."""
    import specdec.spec_decode.proposers.factory as factory_module

    original, loaded = factory_module.load_model, {}

    def load_once(path, dtype, *args, **kwargs):
        key = (str(path), str(dtype), *(id(a) if isinstance(a, torch.Tensor) else repr(a)
                                        for a in (*args, *sorted(kwargs.items()))))
        if key not in loaded:
            loaded[key] = original(path, dtype, *args, **kwargs)
        return loaded[key]

    factory_module.load_model = load_once
    try:
        yield
    finally:
        factory_module.load_model = original


def warm_up(llms: list[specdec.LLM], prompts: list[list[int]]) -> None:
    for llm in llms:
        llm.generate(prompt_token_ids=prompts, sampling_params=specdec.SamplingParams(temperature=0, max_tokens=4))


def phase_a(plain: Ours, spec: Ours, ids: dict[str, list[list[int]]], batch: int, reps: int) -> dict:
    """Target-only vs speculative per class at one batch size; raw per-run data kept."""
    out = {}
    for cls, prompts in ids.items():
        groups = [[p] for p in prompts] if batch == 1 else [[prompts[i % len(prompts)] for i in range(batch)]]
        tokens, seconds = {"plain": 0, "spec": 0}, {"plain": 0.0, "spec": 0.0}
        per_group, metrics, lossless = [], [], True
        for group in groups:
            runs = interleave({"plain": plain, "spec": spec}, group, reps)
            entry = {}
            for name in ("plain", "spec"):
                n, s = rate(runs[name])
                tokens[name] += n
                seconds[name] += s
                entry[name] = {"tokens": n, "seconds": [r["seconds"] for r in runs[name]]}
            metrics += [m for r in runs["spec"] for m in r["metrics"]]
            same = all(r["tokens"] == runs["plain"][0]["tokens"] for r in runs["spec"] + runs["plain"])
            lossless &= same
            entry["identical_tokens"] = same
            per_group.append(entry)
        out[cls] = {
            "plain_tokens_per_s": tokens["plain"] / seconds["plain"],
            "spec_tokens_per_s": tokens["spec"] / seconds["spec"],
            "speedup": (tokens["spec"] / seconds["spec"]) / (tokens["plain"] / seconds["plain"]),
            "identical_tokens": lossless,
            **aggregate_metrics(metrics),
            "runs": per_group,
        }
        print(f"  batch {batch} {cls:>5}: plain {out[cls]['plain_tokens_per_s']:.2f} tok/s, spec "
              f"{out[cls]['spec_tokens_per_s']:.2f} tok/s, speedup {out[cls]['speedup']:.2f}x", flush=True)
    return out


def phase_b(spec: Ours, theirs: Transformers, ids: dict[str, list[list[int]]], reps: int) -> dict:
    """Our speculative engine vs transformers' at batch 1, interleaved, per class."""
    out = {}
    for cls, prompts in ids.items():
        tokens, seconds, identical, per_prompt = {"ours": 0, "hf": 0}, {"ours": 0.0, "hf": 0.0}, 0, []
        for prompt in prompts:
            runs = interleave({"ours": spec, "hf": theirs}, [prompt], reps)
            entry = {}
            for name in ("ours", "hf"):
                n, s = rate(runs[name])
                tokens[name] += n
                seconds[name] += s
                entry[name] = {"tokens": n, "seconds": [r["seconds"] for r in runs[name]]}
            entry["identical_tokens"] = runs["ours"][-1]["tokens"] == runs["hf"][-1]["tokens"]
            identical += entry["identical_tokens"]
            per_prompt.append(entry)
        ours, hf = tokens["ours"] / seconds["ours"], tokens["hf"] / seconds["hf"]
        out[cls] = {"ours_tokens_per_s": ours, "transformers_tokens_per_s": hf, "ours_over_transformers": ours / hf,
                    "identical_to_transformers": f"{identical}/{len(prompts)}", "runs": per_prompt}
        print(f"  transformers {cls:>5}: ours {ours:.2f} tok/s, transformers {hf:.2f} tok/s -> {ours / hf:.2f}x",
              flush=True)
    return out


def load_transformers(target_path: str, draft_path: str | None, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    target = AutoModelForCausalLM.from_pretrained(target_path, dtype=dtype).eval()
    draft = AutoModelForCausalLM.from_pretrained(draft_path, dtype=dtype).eval() if draft_path else None
    return target, draft


def plot(path: Path, results: dict, title: str) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib is not importable: no plot (pip install matplotlib, a bench-only dependency)")
        return None
    batches = list(results["phase_a"])
    fig, axes = plt.subplots(1, len(batches), figsize=(6 * len(batches), 4), squeeze=False)
    series = [("measured", "speedup"), ("Thm 3.8", "predicted_theorem_3_8"),
              ("Thm 3.8 with v(k)", "predicted_with_v_k"), ("measured round mix", "predicted_round_mix")]
    for ax, batch in zip(axes[0], batches):
        classes = list(results["phase_a"][batch])
        rows = results["phase_a"][batch]
        bars = [(label, [rows[c][key] or 0.0 for c in classes]) for label, key in series]
        if batch == "1" and results.get("phase_b"):
            bars.append(("ours / transformers", [results["phase_b"][c]["ours_over_transformers"] for c in classes]))
        width = 0.8 / len(bars)
        for j, (label, values) in enumerate(bars):
            ax.bar([i + j * width for i in range(len(classes))], values, width, label=label)
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.set_xticks([i + 0.4 - width / 2 for i in range(len(classes))], classes)
        ax.set(ylabel="x target-only (or x transformers)", title=f"batch {batch}")
        ax.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    out = path.with_suffix(".png")
    fig.savefig(out, dpi=110, bbox_inches="tight")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.speed.e2e", description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", default="smollm2", help="folder, or smollm2 | qwen-0.5b | qwen-1.5b")
    parser.add_argument("--draft", default=None,
                        help="draft model for draft_model / combined ('self' with --draft-quantization), or the "
                             "EAGLE-3 head folder for eagle3")
    parser.add_argument("--method", choices=SPECULATIVE_METHODS, required=True)
    parser.add_argument("--adaptive", action="store_true")
    parser.add_argument("--verify", choices=VERIFY_METHODS, default="token",
                        help="verification of sampled chains: token-wise or block (SpeculativeConfig.verify)")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--tree", default=None, help="draft a token tree: e.g. 3,2,1,1 or dynamic (default: chains)")
    parser.add_argument("--tree-budget", type=int, default=16, help="node budget of a dynamic tree")
    parser.add_argument("--tree-policy", choices=["measured", "always"], default="measured",
                        help="tree or chain per round by measured cost, or a tree every round")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--batch", type=int, nargs="+", default=[1])
    parser.add_argument("--prompts", default=",".join(PROMPT_CLASSES), help="comma-separated prompt classes")
    parser.add_argument("--prompts-per-class", type=int, default=None, help="the first N files of each class")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                        help="time runs by wall clock, or by process CPU time (a shared, loaded machine)")
    parser.add_argument("--reps", type=int, default=2)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--quantization", choices=["int8", "int4"], default=None,
                        help="LLM(quantization=...) of the target (both engines)")
    parser.add_argument("--draft-quantization", choices=["int8", "int4"], default=None,
                        help="SpeculativeConfig(draft_quantization=...); with --draft self: a quantised copy of the "
                             "target drafts")
    parser.add_argument("--quantize-lm-head", action="store_true", default=None,
                        help="LLM(quantize_lm_head=True): the target's head quantised too (a tied one as a copy)")
    parser.add_argument("--draft-quantize-lm-head", action="store_true", default=None,
                        help="SpeculativeConfig(draft_quantize_lm_head=True)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-transformers", action="store_true", help="skip phase B")
    parser.add_argument("--transformers-separate", action="store_true",
                        help="low memory: free our engines before loading transformers and compare with phase A's "
                             "speculative timings (not interleaved)")
    add_record_flag(parser)
    args = parser.parse_args(argv)

    set_threads(args.threads)
    set_clock(args.clock)
    if args.temperature > 0:
        warm_up_sampling()
    meta = {**machine_info(), "clock": args.clock}
    target_path = resolve_model(args.target)
    draft_path = resolve_model(args.draft) if args.draft else None
    spec_config = specdec.SpeculativeConfig(method=args.method, draft_model=draft_path,
                                            draft_quantization=args.draft_quantization,
                                            draft_quantize_lm_head=args.draft_quantize_lm_head,
                                            num_speculative_tokens=args.k, adaptive=args.adaptive,
                                            verify=args.verify, tree=parse_tree(args.tree),
                                            tree_budget=args.tree_budget, tree_policy=args.tree_policy)
    prompts = load_prompts(args.prompts.split(","), args.prompts_per_class)
    print(f"{meta['machine']}, torch {meta['torch']}, transformers {meta['transformers']}, "
          f"{torch.get_num_threads()} thread(s), load {meta['load_average_at_start'][0]:.1f}", flush=True)

    tokenizer = Tokenizer.from_dir(target_path)
    ids = {cls: [chat_token_ids(tokenizer, p.text) for p in ps] for cls, ps in prompts.items()}
    # KV pools sized for this run only: the longest prompt + max tokens + lookahead, for every request at once
    lookahead = spec_config.tree_nodes(args.k)  # k, or a tree's node count
    max_model_len = -(-(max(len(p) for ps in ids.values() for p in ps) + args.max_tokens + lookahead + 2) // 16) * 16
    engine_kwargs = {"dtype": args.dtype, "max_model_len": max_model_len, "seed": args.seed,
                     "num_kv_blocks": max(args.batch) * (max_model_len // 16 + 1) + 2,
                     "enable_prefix_caching": False,  # every repetition pays its full prefill, as transformers does
                     "quantization": args.quantization, "quantize_lm_head": args.quantize_lm_head}
    plain_llm = specdec.LLM(target_path, **engine_kwargs)
    with reuse_target_weights(plain_llm):  # one copy of the target's weights for both engines
        spec_llm = specdec.LLM(target_path, speculative=spec_config, **engine_kwargs)
    dtype, eos = spec_llm.engine.config.dtype, list(spec_llm.engine.config.eos_token_ids)
    params = specdec.SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=args.seed)
    plain, spec = Ours(plain_llm, params), Ours(spec_llm, params)
    warm_up([plain_llm, spec_llm], next(iter(ids.values()))[:1])

    target_model, config = spec_llm.engine.model, spec_llm.engine.model_config
    meta["prepacked_linears"] = any(getattr(m, "packed_copy", None) is not None for m in target_model.modules())
    meta["batch_invariant_linears"] = any(getattr(m, "invariant_weight", None) is not None
                                          for m in target_model.modules())
    draft_model, draft_config, eagle3_head = draft_step_model(spec_llm)

    results: dict = {"phase_a": {}, "costs": {}}
    for batch in args.batch:
        print(f"phase A, batch {batch}: target-only vs {args.method}{' (adaptive)' if args.adaptive else ''}",
              flush=True)
        rows = phase_a(plain, spec, ids, batch, args.reps)
        results["costs"][str(batch)] = {}
        for cls, row in rows.items():
            context = round(sum(len(p) for p in ids[cls]) / len(ids[cls]) + args.max_tokens / 2)
            costs = measure_costs(target_model, draft_model, config, draft_config, batch, context, args.k,
                                  eagle3_head=eagle3_head)
            results["costs"][str(batch)][cls] = costs
            row["c"], row["v_k"] = costs["c"], costs["v_k"]
            row["predicted_theorem_3_8"] = improvement(row["alpha"], args.k, costs["c"])
            row["predicted_with_v_k"] = improvement(row["alpha"], args.k, costs["c"], costs["v_k"])
            row["predicted_round_mix"] = round_mix(row, args.k, costs["c"], costs["v"])
        results["phase_a"][str(batch)] = rows

    if 1 in args.batch and not args.no_transformers:
        mode = "separate" if args.transformers_separate else "interleaved"
        print(f"phase B, batch 1: ours vs transformers ({mode})", flush=True)
        del plain, plain_llm, target_model, draft_model, eagle3_head
        if args.transformers_separate:
            del spec, spec_llm
        gc.collect()
        hf_target, hf_draft = load_transformers(target_path, draft_path if spec_config.uses_draft_model else None,
                                                dtype)
        theirs = Transformers(hf_target, hf_draft, args.method, args.k, args.adaptive, args.temperature,
                              args.max_tokens, eos, args.seed)
        if args.transformers_separate:
            results["phase_b"] = phase_b_separate(theirs, ids, args.reps, results["phase_a"]["1"])
        else:
            results["phase_b"] = phase_b(spec, theirs, ids, args.reps)
        results["transformers_config"] = theirs.description

    report(results, args)
    name = "_".join(filter(None, [
        "e2e", slug(Path(target_path).name), args.quantization,
        slug(Path(draft_path).name) if draft_path else None, args.draft_quantization, args.method,
        "adaptive" if args.adaptive else None, "block" if args.verify == "block" else None, f"k{args.k}",
        "b" + "-".join(map(str, args.batch)),
        f"T{args.temperature:g}", f"t{args.threads}",
    ]))
    path = write_json(name, {
        "meta": {**meta, "target": target_path, "draft": draft_path, "target_config": model_sizes(target_path),
                 "draft_config": model_sizes(draft_path) if draft_path != "self" else None, "method": args.method,
                 "quantization": args.quantization, "draft_quantization": args.draft_quantization,
                 "adaptive": args.adaptive, "verify": args.verify, "k": args.k, "temperature": args.temperature,
                 "batch": args.batch,
                 "max_tokens": args.max_tokens, "reps": args.reps, "dtype": args.dtype, "threads": args.threads,
                 "prompts": {cls: [p.name for p in ps] for cls, ps in prompts.items()},
                 "command": "python -m bench.speed.e2e " + " ".join(sys.argv[1:] if argv is None else argv)},
        **results,
    }, record=args.record)
    picture = plot(path, results, f"{Path(target_path).name} {args.method}{' adaptive' if args.adaptive else ''} "
                                  f"k={args.k} T={args.temperature:g}, {args.threads} thread(s)")
    print(f"wrote {path}" + (f" and {picture}" if picture else ""))
    return 0


def phase_b_separate(theirs: Transformers, ids: dict[str, list[list[int]]], reps: int, phase_a_rows: dict) -> dict:
    """transformers alone (our engines freed), against phase A's batch-1 speculative rates: not interleaved."""
    out = {}
    for cls, prompts in ids.items():
        tokens, seconds = 0, 0.0
        for prompt in prompts:
            n, s = rate([theirs.run([prompt]) for _ in range(reps)])
            tokens, seconds = tokens + n, seconds + s
        ours, hf = phase_a_rows[cls]["spec_tokens_per_s"], tokens / seconds
        out[cls] = {"ours_tokens_per_s": ours, "transformers_tokens_per_s": hf, "ours_over_transformers": ours / hf,
                    "interleaved": False}
        print(f"  transformers {cls:>5}: ours (phase A) {ours:.2f} tok/s, transformers {hf:.2f} tok/s -> "
              f"{ours / hf:.2f}x", flush=True)
    return out


def report(results: dict, args) -> None:
    header = ["batch", "class", "plain tok/s", "spec tok/s", "speedup", "Thm3.8", "Thm+v(k)", "mix", "accept",
              "alpha", "tau", "spec steps", "draft len", "c", "v(k)", "lossless", "vs HF"]
    table = []
    for batch, rows in results["phase_a"].items():
        for cls, r in rows.items():
            hf = results.get("phase_b", {}).get(cls, {}).get("ours_over_transformers") if batch == "1" else None
            table.append([batch, cls, r["plain_tokens_per_s"], r["spec_tokens_per_s"], r["speedup"],
                          r["predicted_theorem_3_8"], r["predicted_with_v_k"], r["predicted_round_mix"],
                          r["acceptance_rate"], r["alpha"], r["tau"], r["speculating_step_fraction"],
                          r["mean_draft_length"], r["c"], r["v_k"],
                          r["identical_tokens"] if args.temperature == 0 else "n/a", hf])
    print(f"\n{args.method}{' adaptive' if args.adaptive else ''}, verify={args.verify}, k={args.k}, "
          f"T={args.temperature:g}, {args.threads} thread(s), max {args.max_tokens} tokens, median of {args.reps}")
    print_table(table, header)
    for batch, rows in results["phase_a"].items():
        for cls, r in rows.items():
            positions = ", ".join(f"{p:.2f}" for p in r["per_position_acceptance"] if p is not None)
            print(f"batch {batch} {cls}: per-position acceptance [{positions}]")
    if any(b != 1 for b in args.batch):
        print("batch > 1: ours only (transformers' assisted generation / prompt lookup support batch size 1 only)")


if __name__ == "__main__":
    sys.exit(main())
