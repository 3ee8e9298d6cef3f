"""bench.speed.tp without models: configuration names, the collective cases, and the summary's arithmetic."""

import pytest
import torch

from bench.speed import tp

pytestmark = pytest.mark.bench


def test_configs_cover_both_decodings_and_three_layouts():
    assert [tp.parse_config(c) for c in tp.CONFIGS] == [
        (d, n, t) for d in ("plain", "spec") for n, t in ((1, 1), (1, 2), (2, 1))]


def test_collective_cases_use_the_shapes_the_engine_sends():
    cases = {name: (shape, dtype) for name, shape, dtype in tp.collective_cases(1536, 151936, torch.bfloat16, [256])}
    assert cases["all_reduce [5, 1536] bfloat16"] == ((5, 1536), torch.bfloat16)
    assert cases["gather fp32 [1, 75968] -> [1, 151936]"] == ((1, 75968), torch.float32)
    assert cases["broadcast int64 [256]"] == ((256,), torch.int64)


def run(tokens, seconds, cpu, steps, collectives=None):
    row = {"tokens": tokens, "seconds": seconds, "cpu_seconds": cpu, "steps": steps}
    if collectives:
        row["collectives"] = collectives
        row["collective_seconds"] = {k: 0.1 * v for k, v in collectives.items()}
    return {"runs": [row], "load_average_after": [1.0, 1.0, 1.0]}


def test_summary_medians_counts_and_token_check():
    coll = {"all_reduce": 57 * 4, "broadcast": 4, "gather": 4}
    runs = {"plain/tp1x1": [run([1, 2, 3, 4], 2.0, 1.0, 4), run([1, 2, 3, 4], 4.0, 1.0, 4)],
            "plain/tp2x1": [run([1, 2, 3, 4], 8.0, 16.0, 4, coll), run([1, 2, 3, 4], 8.0, 16.0, 4, coll)],
            "spec/tp2x1": [run([1, 2, 9, 9], 1.0, 1.0, 2, coll)]}
    out = tp.summarize(runs, None)
    assert out["plain/tp1x1"]["tok_s_wall"] == 4 / 3.0  # the median of 2.0 and 4.0 s
    assert out["plain/tp2x1"]["tok_s_cpu"] == 4 / 16.0
    assert out["plain/tp2x1"]["collectives_per_step"] == {"all_reduce": 57, "broadcast": 1, "gather": 1}
    assert out["plain/tp2x1"]["same_tokens_as_plain_tp1x1"] is True
    assert out["spec/tp2x1"]["same_tokens_as_plain_tp1x1"] is False
    assert out["spec/tp2x1"]["tokens_per_step"] == 2.0
