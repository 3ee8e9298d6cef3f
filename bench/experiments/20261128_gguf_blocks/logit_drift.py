"""How far the logits move when a GGUF's blocks are quantised again (int4 / int8) or run as stored ("gguf"),
against the file's own weights in float32 (the converted folder: gguf's dequantisation, dense).

    python logit_drift.py MODEL.gguf [--dtype float32] [--threads 2] OUT.json

Per variant, over the positions of a few chat prompts (bench prose / code / copy prompts): the largest and the
mean |logit - reference|, the mean KL(reference || variant) of the next-token distributions and the share of
positions whose top-1 token agrees with the reference's. One prefill per prompt (all positions' logits at once).
"""

import argparse
import json
import sys

import torch

from bench.common import chat_token_ids, load_prompts
from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model, resolve_model_path
from specdec.model.config import ModelConfig
from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.tokenizer.tokenizer import Tokenizer


def prompt_logits(model, config, ids: list[int], dtype: torch.dtype) -> torch.Tensor:
    """fp32 [len(ids), V]: the next-token logits after every prefix of ``ids`` (one prefill)."""
    block = 16
    blocks = -(-len(ids) // block)
    manager = BlockManager(blocks, block)
    runner = ModelRunner(model, KVPool(config, blocks, block, dtype, torch.device("cpu")), manager,
                         torch.device("cpu"))
    manager.allocate(0, len(ids))
    with torch.no_grad():
        return runner.forward([ForwardItem(0, ids, 0, len(ids))]).float()


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("gguf")
    parser.add_argument("out")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--variants", nargs="+", default=["gguf", "int4", "int8"])
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = resolve_model_path(args.gguf)
    config = ModelConfig.from_json(folder)
    tok = Tokenizer(folder)
    prompts = load_prompts(["prose", "code", "copy"], per_class=2)
    ids = [chat_token_ids(tok, p.text)[:384] for group in prompts.values() for p in group]
    dtype = getattr(torch, args.dtype)
    reference_model = load_model(folder, torch.float32, torch.device("cpu"), 512, config)
    reference = [prompt_logits(reference_model, config, x, torch.float32) for x in ids]
    del reference_model
    results = {}
    for variant in args.variants:
        model = load_model(folder, dtype, torch.device("cpu"), 512, config, quantization=variant,
                           gguf_path=args.gguf)
        diffs, kls, agree, n = [], [], 0, 0
        for x, ref in zip(ids, reference):
            got = prompt_logits(model, config, x, dtype)
            diffs.append((got - ref).abs())
            logp_ref, logp = ref.log_softmax(-1), got.log_softmax(-1)
            kls.append((logp_ref.exp() * (logp_ref - logp)).sum(-1))
            agree += int((got.argmax(-1) == ref.argmax(-1)).sum())
            n += len(x)
        d = torch.cat([t.flatten() for t in diffs])
        results[variant] = {"max_abs_diff": float(d.max()), "mean_abs_diff": float(d.mean()),
                            "mean_kl": float(torch.cat(kls).mean()), "top1_agreement": agree / n,
                            "positions": n, "quant_counts": getattr(model, "quant_counts", None)}
        print(variant, json.dumps(results[variant]), flush=True)
        del model
    results["meta"] = {"gguf": args.gguf, "dtype": args.dtype, "threads": args.threads,
                       "reference": "the converted folder (gguf's dequantisation) in float32, dense"}
    with open(args.out, "w") as f:
        json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
