"""specdec.model.linear: the prepacked path computes what F.linear computes, for every row count."""

import pytest
import torch
from helpers import small_llm

from specdec.model.linear import PREPACK_MIN_ROWS, Linear, prepack_linears, prepack_supported

pytestmark = pytest.mark.skipif(not prepack_supported(torch.float32, torch.device("cpu")),
                                reason="this torch has no oneDNN prepacked linear")


@pytest.mark.parametrize("bias", [False, True])
def test_packed_linear_matches_f_linear_for_1_to_33_rows(bias):
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias)
    layer.prepack()
    for rows in range(1, 34):
        x = torch.randn(rows, 96)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias),
                                   atol=1e-5, rtol=1e-5)


def test_packed_path_is_taken_from_prepack_min_rows(monkeypatch):
    layer = Linear(8, 8)
    layer.prepack()
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, PREPACK_MIN_ROWS - 1, PREPACK_MIN_ROWS, 9):
        layer(torch.randn(rows, 8))
    assert calls == [PREPACK_MIN_ROWS, 9]


def test_prepack_follows_a_weight_change_only_when_asked():
    layer = Linear(16, 16, bias=False)
    layer.prepack()
    x = torch.randn(8, 16)
    before = layer(x)
    with torch.no_grad():
        layer.weight.mul_(2)
    torch.testing.assert_close(layer(x), before)  # stale copy: documented, prepack() again after edits
    layer.prepack()
    torch.testing.assert_close(layer(x), 2 * before, atol=1e-5, rtol=1e-5)
    layer.unpack()
    torch.testing.assert_close(layer(x), 2 * before, atol=1e-5, rtol=1e-5)


def test_prepack_linears_counts_bytes_and_covers_every_linear():
    model = torch.nn.Sequential(Linear(8, 16), torch.nn.ReLU(), Linear(16, 4, bias=False))
    assert prepack_linears(model, required=True, release_weights=False) == (8 * 16 + 16 * 4) * 4
    assert all(m.packed_weight is not None and not m.weight_released for m in model if isinstance(m, Linear))


def test_released_weights_leave_one_copy_and_the_same_outputs_for_every_row_count():
    torch.manual_seed(0)
    model = torch.nn.Sequential(Linear(24, 40), torch.nn.ReLU(), Linear(40, 8, bias=False))
    xs = [torch.randn(rows, 24) for rows in (1, 2, 5)] + [torch.randn(2, 3, 24)]
    expected = [model(x) for x in xs]
    assert prepack_linears(model) == 0  # released: the packed copies replace the plain weights
    for m in (model[0], model[2]):
        assert m.weight_released and m.weight.is_meta and m.packed_weight is not None
        assert m.weight.shape == (m.out_features, m.in_features) and m.weight.dtype == torch.float32
    for x, want in zip(xs, expected):
        torch.testing.assert_close(model(x), want, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="released"):
        model[0].unpack()
    with pytest.raises(ValueError, match="released"):
        model[0].prepack()


def test_released_weights_work_while_another_thread_compiles():
    """``torch.compiler.is_compiling()`` is one flag for the whole process: while any thread runs a torch.compile
    (kernels/philox.py compiles its CPU noise in a background thread once sampling starts), it is True in every
    thread. An eager forward elsewhere must still take the packed path - with the plain weight released it has no
    other (it raised "cannot trace", and an EAGLE-3 head stopped drafting while the noise compiled)."""
    import threading

    session = getattr(torch.compiler, "_compile_session_context", None)  # what Dynamo holds while it compiles
    if session is None:
        pytest.skip("this torch has no compile-session flag")
    torch.manual_seed(0)
    layer = Linear(24, 40)
    x = torch.randn(3, 24)
    want = layer(x)
    layer.prepack(release_weight=True)
    entered, done = threading.Event(), threading.Event()

    def compiling_thread():
        with session():
            entered.set()
            done.wait()

    thread = threading.Thread(target=compiling_thread)
    thread.start()
    try:
        assert entered.wait(30)
        assert torch.compiler.is_compiling()  # the flag is visible here, in another thread
        torch.testing.assert_close(layer(x), want, atol=1e-5, rtol=1e-5)
    finally:
        done.set()
        thread.join()


def test_a_weight_shared_with_another_module_keeps_its_plain_rows():
    embedding = torch.nn.Embedding(50, 16)
    head = Linear(16, 50, bias=False)
    head.weight = embedding.weight  # a tied LM head
    model = torch.nn.ModuleDict({"embed": embedding, "head": head, "other": Linear(16, 16)})
    assert prepack_linears(model) == 50 * 16 * 4  # the tied head's packed copy is the only extra
    assert not head.weight_released and head.weight is embedding.weight and head.packed_weight is not None
    assert model["other"].weight_released
    ids = torch.tensor([3, 7])
    torch.testing.assert_close(head(embedding(ids)), embedding(ids) @ embedding.weight.T, atol=1e-5, rtol=1e-5)


def test_auto_prepack_skips_when_memory_is_short_and_required_does_not(monkeypatch):
    import specdec.model.linear as linear

    monkeypatch.setattr(linear, "available_memory_bytes", lambda: 1000)  # bytes: far less than 2 x the copies
    model = torch.nn.Sequential(Linear(32, 32))
    assert prepack_linears(model, release_weights=False) == 0 and model[0].packed_weight is None
    assert prepack_linears(model, required=True, release_weights=False) == 32 * 32 * 4
    assert model[0].packed_weight is not None
    fresh = torch.nn.Sequential(Linear(32, 32))  # releasing adds nothing, so short memory does not stop it
    assert prepack_linears(fresh) == 0 and fresh[0].packed_weight is not None


@pytest.mark.parametrize("setting", [None, False])
def test_target_and_draft_models_follow_the_engine_setting(tiny_pair, setting):
    import specdec

    target, draft = tiny_pair
    llm = small_llm(target, dtype="float32", prepack_weights=setting,
                      speculative=specdec.SpeculativeConfig(draft_model=draft, num_speculative_tokens=2))
    draft_model = llm.engine.speculative.proposer.runner.model
    for model in (llm.engine.model, draft_model):
        packed = [m.packed_weight is not None for m in model.modules() if isinstance(m, Linear)]
        assert packed and all(packed) == (setting is None) and any(packed) == (setting is None)


bf16_only = pytest.mark.skipif(not prepack_supported(torch.bfloat16, torch.device("cpu")),
                               reason="no native bf16 on this CPU (or no oneDNN): bf16 is not prepacked")


@bf16_only
@pytest.mark.parametrize("bias", [False, True])
def test_packed_bf16_linear_matches_fp32_math_for_1_to_33_rows(bias):
    torch.manual_seed(0)
    layer = Linear(96, 200, bias=bias).to(torch.bfloat16)
    layer.prepack()
    assert layer.packed_bf16
    for rows in range(1, 34):
        x = torch.randn(rows, 96).bfloat16()
        out = layer(x)
        assert out.dtype == torch.bfloat16 and out.shape == (rows, 200)
        # fp32 math on the same bf16 values; the only rounding left is the bf16 output (8 bits of mantissa)
        bias32 = None if layer.bias is None else layer.bias.float()
        expected = torch.nn.functional.linear(x.float(), layer.weight.float(), bias32)
        torch.testing.assert_close(out.float(), expected, atol=2e-2, rtol=1e-2)
        torch.testing.assert_close(out, torch.nn.functional.linear(x, layer.weight, layer.bias), atol=2e-2, rtol=1e-2)


@bf16_only
def test_packed_bf16_path_is_taken_from_one_row(monkeypatch):
    from specdec.model.linear import PREPACK_MIN_ROWS_BF16

    layer = Linear(8, 8).to(torch.bfloat16)
    layer.prepack()
    calls = []
    real = torch.ops.mkldnn._linear_pointwise
    monkeypatch.setattr(torch.ops.mkldnn, "_linear_pointwise", lambda *a: calls.append(a[0].shape[0]) or real(*a))
    for rows in (1, 2, 3, 4, 9):
        layer(torch.randn(rows, 8).bfloat16())
    assert PREPACK_MIN_ROWS_BF16 == 1 and calls == [1, 2, 3, 4, 9]
    layer.unpack()
    layer(torch.randn(4, 8).bfloat16())
    assert calls == [1, 2, 3, 4, 9] and not layer.packed_bf16


def test_prepack_is_refused_for_float16():
    layer = Linear(8, 8).to(torch.float16)
    with pytest.raises(ValueError, match="float32 and bfloat16"):
        layer.prepack()
    assert not prepack_supported(torch.float16, torch.device("cpu"))


@bf16_only
def test_bf16_model_is_prepacked_and_prompt_lookup_matches_plain_greedy(tiny_pair):
    import specdec

    target, _ = tiny_pair
    llm = small_llm(target, dtype="bfloat16", batch_invariant=False)  # oneDNN's packed copies, not the invariant GEMM
    linears = [m for m in llm.engine.model.modules() if isinstance(m, Linear)]
    assert linears and all(m.packed_weight is not None and m.packed_bf16 for m in linears)
    params = specdec.SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    prompt = [[3, 17, 5, 9, 3, 17]]
    packed = llm.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0].token_ids
    spec = small_llm(target, dtype="bfloat16", batch_invariant=False, speculative=specdec.SpeculativeConfig(
        method="prompt_lookup", num_speculative_tokens=3))
    assert spec.generate(prompt_token_ids=prompt, sampling_params=params)[0].outputs[0].token_ids == packed


def test_batch_invariant_option(tiny_pair):
    """None runs the invariant kernels where AMX runs the GEMM (bf16, CPU), True wherever they run, False never;
    True where they cannot run is a ValueError naming what is needed."""
    from specdec.kernels.cpu import gemm
    from specdec.model import batch_invariant

    target, _ = tiny_pair
    with pytest.raises(ValueError, match="bfloat16 model on a CPU with AVX512_BF16"):
        small_llm(target, dtype="float32", batch_invariant=True)
    with pytest.raises(ValueError, match="batch_invariant must be None"):
        small_llm(target, dtype="bfloat16", batch_invariant="yes")
    if not batch_invariant.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    for option, on in ((None, gemm.backend() == "amx"), (True, True), (False, False)):
        model = small_llm(target, dtype="bfloat16", batch_invariant=option).engine.model
        linears = [m for m in model.modules() if isinstance(m, Linear)]
        assert all((m.invariant_weight is not None) == on for m in linears), option
        assert all(m.self_attn.batch_invariant == on for m in model.layers), option
        assert all(m.weight_released for m in linears) or not on  # the packed copy replaces the plain weight
    fp32 = small_llm(target, dtype="float32").engine.model  # float32: never (its linears run MKL)
    assert not any(m.invariant_weight is not None for m in fp32.modules() if isinstance(m, Linear))


def test_batch_invariant_refuses_what_it_cannot_keep(tmp_path):
    """A head layout the invariant attention cannot take: True is a ValueError naming it, None runs the old kernels;
    the static forward in compile mode (which would trace torch's ops instead) is refused."""
    from specdec.model import batch_invariant
    from tests.tiny_models import make_tiny_model

    if not batch_invariant.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    path = str(tmp_path / "head_dim_8")
    make_tiny_model(path, "llama", hidden_size=64, num_heads=8, num_kv_heads=2, with_tokenizer=False)  # head dim 8
    with pytest.raises(ValueError, match="head dim 8"):
        small_llm(path, dtype="bfloat16", batch_invariant=True)
    model = small_llm(path, dtype="bfloat16").engine.model
    assert not any(m.self_attn.batch_invariant for m in model.layers)
    assert model.lm_head.invariant_weight is None  # the oneDNN copies, not half a mode


def test_static_compile_is_refused_with_invariant_kernels(tiny_pair):
    from specdec.model import batch_invariant

    if not batch_invariant.supported(torch.bfloat16, torch.device("cpu")):
        pytest.skip("no AVX512_BF16 here")
    llm = small_llm(tiny_pair[0], dtype="bfloat16", batch_invariant=True, prepack_weights=False)
    with pytest.raises(ValueError, match="batch_invariant=False to compile"):
        llm.engine.runner.enable_static_forward("compile", (1,), 64, 2)
