import sys
import time

import specdec
from bench.common import chat_token_ids, load_prompts, resolve_model, set_threads

set_threads(1)
cls = sys.argv[1]; n = int(sys.argv[2])
texts = {}
for name in ["plain", "k=1", "k=4", "adaptive"]:
    spec = None if name == "plain" else specdec.SpeculativeConfig(method="draft_model", draft_model=resolve_model("qwen-0.5b"), num_speculative_tokens=4 if name == "adaptive" else int(name[2:]), adaptive=name == "adaptive", draft_quantization="int4")
    llm = specdec.LLM(resolve_model("qwen-1.5b"), dtype="float32", quantization="int8", max_model_len=2048, num_kv_blocks=256, speculative=spec)
    ids = chat_token_ids(llm.engine.tokenizer, load_prompts([cls], 1)[cls][0].text)
    t = time.time()
    o = llm.generate(prompt_token_ids=[ids], sampling_params=specdec.SamplingParams(temperature=0, max_tokens=n, ignore_eos=True))[0]
    texts[name] = o.outputs[0].token_ids
    print(name, f"{n / (time.time() - t):.2f} tok/s", o.metrics.get("acceptance_rate"), flush=True)
    del llm
ref = texts["plain"]
for k, v in texts.items():
    print(k, "identical" if v == ref else f"differs at {next(i for i, (a, b) in enumerate(zip(v, ref)) if a != b)}")
