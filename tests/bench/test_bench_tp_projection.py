"""bench.projection.tp: the per-rank weight bytes against the published parameter counts, the shards adding up,
and the collectives' terms vanishing at TP=1."""

import pytest

from bench.projection import tp

pytestmark = pytest.mark.bench


@pytest.mark.parametrize("name,params", [("Llama-3.2-3B", 3.21e9), ("Llama-3.1-8B", 8.03e9 - 0.525e9),
                                         ("Llama-3.1-70B", 70.6e9 - 1.05e9)])
def test_one_rank_streams_every_weight_but_the_untied_embedding(name, params):
    # model cards: 3.21B (tied), 8.03B and 70.6B (untied: the embedding's V x hidden lookup is not streamed)
    assert tp.rank_weight_bytes(tp.MODELS[name], 1) / 2 == pytest.approx(params, rel=0.01)


@pytest.mark.parametrize("n", [2, 4, 8])
def test_shards_add_up_to_the_model_plus_replicated_norms(n):
    m = tp.MODELS["Llama-3.1-70B"]
    norms = 2 * (2 * m["layers"] + 1) * m["hidden"]
    assert n * tp.rank_weight_bytes(m, n) == tp.rank_weight_bytes(m, 1) + (n - 1) * norms


def test_tp1_has_no_collectives_and_c_is_the_byte_ratio():
    args = tp.argparse.Namespace(allreduce="vllm", hbm_efficiency=1.0, context=0, k=4, alphas=[0.7])
    rows = {(r["pair"], r["tp"]): r for r in tp.project(args)}
    one = rows[("Llama-3.2-3B / Llama-3.2-1B", 1)]
    assert one["t1"]["allreduce"] == one["t1"]["gather"] == one["t1"]["broadcast"] == 0
    ratio = tp.rank_weight_bytes(tp.MODELS["Llama-3.2-1B"], 1) / tp.rank_weight_bytes(tp.MODELS["Llama-3.2-3B"], 1)
    assert one["c"] == pytest.approx(ratio)
    assert one["v"] == pytest.approx(1.0)
    two = rows[("Llama-3.2-3B / Llama-3.2-1B", 2)]
    assert two["t1"]["allreduce"] == pytest.approx(57 * tp.allreduce_us("vllm", 2, 3072 * 2))
    assert two["c"] > one["c"]  # the collectives are a larger share of the draft's shorter forward
