import json
import sys

import torch

import specdec
from bench.common import chat_token_ids, load_prompts, resolve_model, set_threads
from specdec.training.features import target_features

set_threads(1)
cls, n = sys.argv[1], int(sys.argv[2])
spec = specdec.SpeculativeConfig(method="draft_model", draft_model=resolve_model("qwen-0.5b"), num_speculative_tokens=4, adaptive=True)
llm = specdec.LLM(resolve_model("qwen-1.5b"), dtype="float32", max_model_len=2048, num_kv_blocks=256, speculative=spec)
cm = llm.engine.speculative.cost_model
print("calibrated: c", round(cm.draft_cost(1), 3), "v(k)", [round(cm.verify_cost(k, 1), 3) for k in range(5)], flush=True)
ids = chat_token_ids(llm.engine.tokenizer, load_prompts([cls], 1)[cls][0].text)
o = llm.generate(prompt_token_ids=[ids], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
text = list(o.outputs[0].token_ids)
print("after: c", round(cm.draft_cost(1), 3), "v(k)", [round(cm.verify_cost(k, 1), 3) for k in range(5)], o.metrics["k_per_step"], flush=True)
del llm
dr = specdec.LLM(resolve_model("qwen-0.5b"), dtype="float32", max_model_len=2048, num_kv_blocks=256)
am = target_features(dr.engine, [ids + text], (1,), torch.float32)[0]["argmax"].tolist()
m = [int(am[len(ids) + p - 1] == text[p]) for p in range(len(text))]
print("match", sum(m) / len(m))
json.dump({"text": text, "match": m}, open(f"/tmp/exp/oracle_fp32_{cls}_{n}.json", "w"))
