"""How well a head drafts: greedy EAGLE-3 decoding of prompts, pooled acceptance figures (docs/metrics.md)."""

from __future__ import annotations

from specdec import SamplingParams, SpeculativeConfig


def acceptance(target: str, head: str, prompt_ids: list[list[int]], max_tokens: int = 64, k: int = 4,
               dtype: str = "float32", **llm_kwargs) -> dict:
    """Greedy decode ``prompt_ids`` with the head at ``head`` drafting ``k`` tokens a round; returns the pooled
    ``{"tau": tokens per verification round (bonus included), "acceptance_rate", "rounds", "token_ids"}``
    (``token_ids``: each prompt's output, for checking against plain decoding)."""
    import specdec

    spec = SpeculativeConfig(method="eagle3", draft_model=head, num_speculative_tokens=k)
    llm = specdec.LLM(target, dtype=dtype, speculative=spec, **llm_kwargs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompt_token_ids=prompt_ids, sampling_params=params)
    rounds = sum(o.metrics["num_rounds"] for o in outs)
    tokens = sum((o.metrics["mean_tokens_per_round"] or 0) * o.metrics["num_rounds"] for o in outs)
    drafted = sum(o.metrics["drafted"] for o in outs)
    accepted = sum(o.metrics["accepted"] for o in outs)
    return {"tau": tokens / max(rounds, 1), "acceptance_rate": accepted / max(drafted, 1), "rounds": rounds,
            "token_ids": [list(o.outputs[0].token_ids) for o in outs]}
