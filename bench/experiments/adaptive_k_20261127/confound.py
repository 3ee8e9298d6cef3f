"""bf16: does each configuration tell a different story, and how hard is each story for the draft?"""
import json
import sys

import torch

import specdec
from bench.common import chat_token_ids, load_prompts, resolve_model, set_threads
from bench.speed.e2e import reuse_target_weights, share_draft_weights
from specdec.training.features import target_features

set_threads(1)
cls, n = sys.argv[1], int(sys.argv[2])
def mk(name):
    spec = None if name == "plain" else specdec.SpeculativeConfig(method="draft_model", draft_model=resolve_model("qwen-0.5b"), num_speculative_tokens=4 if name == "adaptive" else int(name[2:]), adaptive=name == "adaptive", draft_quantization="int4")
    return specdec.LLM(resolve_model("qwen-1.5b"), dtype="bfloat16", quantization="int8", max_model_len=2048, num_kv_blocks=256, speculative=spec)
names = ["plain", "k=1", "k=2", "k=3", "k=4", "adaptive"]
engines = {"plain": mk("plain")}
with reuse_target_weights(engines["plain"]), share_draft_weights():
    for nm in names[1:]: engines[nm] = mk(nm)
draft = engines["k=1"].engine.speculative
dr = specdec.LLM(resolve_model("qwen-0.5b"), dtype="bfloat16", quantization="int4", max_model_len=2048, num_kv_blocks=256)
ids = chat_token_ids(engines["plain"].engine.tokenizer, load_prompts([cls], 1)[cls][0].text)
out = {}
for nm in names:
    for rep in range(2 if nm == "adaptive" else 1):
        if nm == "adaptive": engines[nm].engine.speculative.reset_adaptive()
        text = list(engines[nm].generate(prompt_token_ids=[ids], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0].outputs[0].token_ids)
        am = target_features(dr.engine, [ids + text], (1,), torch.float32)[0]["argmax"].tolist()
        m = [int(am[len(ids) + p - 1] == text[p]) for p in range(len(text))]
        diverge = next((i for i, (a, b) in enumerate(zip(text, out.get("plain", {}).get("text", text))) if a != b), None)
        out[f"{nm}#{rep}"] = {"text": text, "match": m}
        if nm == "plain": out["plain"] = out["plain#0"]
        print(nm, rep, "match rate", round(sum(m) / len(m), 3), "parts from plain at", diverge, flush=True)
json.dump(out, open(f"/tmp/exp/confound_{cls}_{n}.json", "w"))
