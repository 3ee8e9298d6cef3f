"""Real weights: SmolLM2-135M-Instruct from its GGUF, against transformers' own GGUF loading of the same file."""


import pytest
import torch
from helpers import assert_greedy_equal, make_layer_skip_draft, small_llm

from specdec import SamplingParams, SpeculativeConfig
from specdec.checkpoint.default_model import default_gguf_path, default_model_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "<|im_start|>user\nList three primary colors.<|im_end|>\n<|im_start|>assistant\n",
    "Once upon a time, in a small village by the sea,",
]


@pytest.fixture(scope="module")
def model_dir():
    return default_model_path()


@pytest.fixture(scope="module")
def oracle():
    import transformers

    gguf = default_gguf_path()
    model = transformers.AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name,
                                                              dtype=torch.float32)
    return model.eval()


@pytest.fixture(scope="module")
def llm(model_dir):
    return small_llm(model_dir, dtype="float32", max_model_len=512, block_size=16)


def test_prompt_logits_match_transformers_gguf_loading(llm, oracle):
    from specdec.runner.model_runner import ForwardItem

    engine = llm.engine
    for i, prompt in enumerate(PROMPTS[:2]):
        ids = engine.tokenizer.encode(prompt)
        seq_id = 10_000 + i
        engine.block_manager.allocate(seq_id, len(ids))
        try:
            ours = engine.runner.forward([ForwardItem(seq_id, ids, 0, len(ids))])
        finally:
            engine.block_manager.free(seq_id)
        with torch.no_grad():
            ref = oracle(torch.tensor([ids])).logits[0].float()
        assert (ours - ref).abs().max().item() <= 1e-3


def test_32_greedy_tokens_equal_the_oracle(llm, oracle):
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True)
    outs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outs):
        ids = out.prompt_token_ids
        with torch.no_grad():
            ref = oracle.generate(torch.tensor([ids]), max_new_tokens=32, do_sample=False, eos_token_id=None,
                                  pad_token_id=0)[0, len(ids):].tolist()

        def logits_at(prefix, ids=ids):
            with torch.no_grad():
                return oracle(torch.tensor([ids + prefix])).logits[0, -1]

        assert_greedy_equal(out.outputs[0].token_ids, ref, logits_at, context=repr(prompt))




@pytest.fixture(scope="module")
def layer_skip_draft(model_dir, tmp_path_factory):
    return make_layer_skip_draft(model_dir, str(tmp_path_factory.mktemp("skip_draft")), 10)


@pytest.mark.parametrize("k", [3, 8])
def test_layer_skip_draft_greedy_parity(llm, model_dir, layer_skip_draft, k):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    ref = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    spec = small_llm(model_dir, dtype="float32", max_model_len=512, max_num_seqs=4,
                       speculative=SpeculativeConfig(draft_model=layer_skip_draft, num_speculative_tokens=k))
    outs = spec.generate(PROMPTS, params)
    assert [o.outputs[0].token_ids for o in outs] == ref
    drafted = sum(o.metrics["drafted"] for o in outs)
    accepted = sum(o.metrics["accepted"] for o in outs)
    assert 0 < accepted < drafted
