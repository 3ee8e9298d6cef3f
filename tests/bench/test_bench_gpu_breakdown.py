"""The breakdown step's pure parts (``bench.gpu_steps.kernel_groups``, ``graph_timing.copies``, the bound's
bytes, the summary section): kernel names from a real H100 profile classified by group, each rule needed (a
mutant without it misclassifies a real name), the grouping arithmetic on synthetic events. The step itself runs
in ``tests/bench/test_bench_gpu.py``'s dry run."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch import nn

from bench.gpu_steps import graph_timing
from bench.gpu_steps.breakdown import forward_weight_bytes, kv_token_bytes
from bench.gpu_steps.kernel_groups import (
    GROUPS,
    RULES,
    classify_kernel,
    cpu_op_rows,
    device_kernel_rows,
    group_kernels,
)

# Names as bench/results/gpu_h100_20261126/profile.txt prints them (truncated to 60 characters by the profiler's
# table), the kernels of this repository (and the fused ones being added), and untruncated PyTorch / cuBLAS /
# FlashAttention names of the kinds a decode step launches.
REAL = {
    "nvjet_sm90_tst_128x8_64x12_2x1_v_bz_TNT": "GEMM",
    "nvjet_sm90_tst_64x8_64x16_2x1_v_bz_splitK_TNT": "GEMM",
    "void cublasLt::splitKreduce_kernel<32, 16, int, float, __...": "GEMM",
    "aten::mm": "GEMM",
    "_paged_attention_kernel": "attention",
    "_paged_attention_reduce_kernel": "attention",
    "aten::argmax": "sampling+verification",
    "void at::native::elementwise_kernel<128, 4, at::native::g...": "other",
    "void at::native::reduce_kernel<512, 1, at::native::Reduce...": "other",
    "void at::native::index_elementwise_kernel<128, 4, at::nat...": "other",
    "void at::native::vectorized_gather_kernel<16, long>(char*...": "other",
    "void at::native::(anonymous namespace)::CatArrayBatchedCo...": "other",
    "void at::native::(anonymous namespace)::indexSelectSmallI...": "other",
    "Memcpy DtoD (Device -> Device)": "other",
    "Memcpy HtoD (Pinned -> Device)": "other",
    "aten::copy_": "other",
    "aten::amax": "other",
    "aten::mul": "other",
    "_quant_matmul_kernel": "GEMM",
    "_split_k_reduce_kernel": "GEMM",
    "_fused_add_rms_norm_kernel": "norm",
    "_rope_write_kv_kernel": "rope+KV write",
    "_kv_copy_rows_kernel": "rope+KV write",
    "_silu_mul_kernel": "activation",
    "_softmax_temperature_kernel": "sampling+verification",
    "_top_k_top_p_min_p_kernel": "sampling+verification",
    "_spec_sample_kernel": "sampling+verification",
    "_tree_sample_kernel": "sampling+verification",
    "_block_verify_kernel": "sampling+verification",
    "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1_execute_segment_k_off_kernel__5x"
    "_cublas": "GEMM",
    "void gemv2T_kernel_val<int, int, __nv_bfloat16, __nv_bfloat16, float, 128, 16, 4, 4, false, false>": "GEMM",
    "fmha_cutlassF_bf16_aligned_64x64_rf_sm80(PyTorchMemEffAttention::AttentionKernel<cutlass::bfloat16_t>::Params)":
        "attention",
    "void pytorch_flash::flash_fwd_splitkv_kernel<Flash_fwd_kernel_traits<128, 64, 128, 4>, true>": "attention",
    "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x128_4x1x1_kernel0_0": "attention",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4> >(at::native::ReduceOp<float, at::native::MeanOps<float, float, float, "
    "float>, unsigned int, float, 4, 4>)": "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::rsqrt_kernel_cuda(at::TensorIteratorBase&)::"
    "{lambda()#2}::operator()() const::{lambda()#2}::operator()() const::{lambda(float)#1}, std::array<char*, 2ul> >":
        "norm",
    "void at::native::vectorized_elementwise_kernel<4, at::native::(anonymous namespace)::silu_kernel(at::"
    "TensorIteratorBase&)::{lambda()#1}::operator()() const::{lambda(c10::BFloat16)#1}, std::array<char*, 2ul> >":
        "activation",
    "void at::native::index_elementwise_kernel<128, 4, at::native::gpu_index_kernel<at::native::index_put_kernel_"
    "impl<at::native::OpaqueType<2> >(at::TensorIterator&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(char*, "
    "char const*, long)#1}>(at::TensorIteratorBase&, c10::ArrayRef<long>, c10::ArrayRef<long>)::{lambda(int)#1}>":
        "rope+KV write",
    "void at::native::_scatter_gather_elementwise_kernel<128, 8, at::native::_cuda_scatter_gather_internal_kernel<"
    "false, long>::operator()<at::native::TensorAssign>(at::TensorIterator&, long, long, long, at::native::"
    "TensorAssign const&)::{lambda(int)#1}>(int, at::native::TensorAssign const&)": "other",
    "void at::native::reduce_kernel<512, 1, at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, "
    "long, 4, 4> >(at::native::ReduceOp<float, at::native::ArgMaxOps<float>, unsigned int, long, 4, 4>)":
        "sampling+verification",
    "void at::native::(anonymous namespace)::cunn_SoftMaxForward<4, float, float, float, at::native::(anonymous "
    "namespace)::SoftMaxForwardEpilogue>(float*, float const*, int)": "sampling+verification",
    "triton_red_fused__to_copy_add_mean_mul_pow_rsqrt_0": "norm",
    "triton_poi_fused_mul_silu_1": "activation",
    "triton_tem_fused_mm_2": "GEMM",
    "aten::silu": "activation",
    "aten::index_put_": "rope+KV write",
    "aten::pow": "norm",
    "aten::exponential_": "sampling+verification",
    "mkldnn::_linear_pointwise": "GEMM",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "attention",
}


@pytest.mark.parametrize("name", REAL)
def test_classify_kernel_on_real_names(name):
    assert classify_kernel(name) == REAL[name]


def test_every_rule_is_needed_by_a_real_name():
    """A mutant without any one rule (or with GEMM tried before attention) misclassifies some name above: the
    rules are not decoration, and the list is strong enough to catch a broken one."""
    assert {group for group, _ in RULES} == set(GROUPS) - {"other"}
    for i, (group, _) in enumerate(RULES):
        mutant = RULES[:i] + RULES[i + 1 :]
        wrong = [n for n, want in REAL.items() if classify_kernel(n, mutant) != want]
        assert wrong, f"dropping the {group} rule changed nothing"
    order = {group: i for i, (group, _) in enumerate(RULES)}
    swapped = list(RULES)
    swapped[order["GEMM"]], swapped[order["attention"]] = swapped[order["attention"]], swapped[order["GEMM"]]
    assert any(classify_kernel(n, tuple(swapped)) != want for n, want in REAL.items())


def test_group_kernels_sums_counts_times_and_shares():
    rows = [("nvjet_sm90_tst_128x8", 60.0, 2), ("_paged_attention_kernel", 10.0, 1), ("_silu_mul_kernel", 5.0, 1),
            ("Memcpy HtoD (Pinned -> Device)", 5.0, 1), ("nvjet_sm90_tst_128x8", 20.0, 1)]  # fmt: skip
    got = group_kernels(rows, top=2)
    assert list(got["groups"]) == list(GROUPS)
    assert got["groups"]["GEMM"] == {"kernels": 3, "us": 80.0, "share": 0.8}
    assert got["groups"]["attention"] == {"kernels": 1, "us": 10.0, "share": 0.1}
    assert got["groups"]["activation"]["share"] == pytest.approx(0.05)
    assert got["groups"]["norm"] == {"kernels": 0, "us": 0.0, "share": 0.0}
    assert got["kernels"] == 6 and got["us"] == 100.0
    assert got["outside_gemm_attention"] == pytest.approx(0.1)
    assert sum(g["share"] for g in got["groups"].values()) == pytest.approx(1.0)
    assert got["top"] == [["nvjet_sm90_tst_128x8", "GEMM", 3, 80.0], ["_paged_attention_kernel", "attention", 1, 10.0]]
    empty = group_kernels([])
    assert empty["us"] == 0 and empty["outside_gemm_attention"] == 0 and empty["top"] == []


def test_device_kernel_rows_keeps_device_events_only():
    def event(name, start, end, device="DeviceType.CUDA", annotation=False):
        return SimpleNamespace(name=name, device_type=device, is_user_annotation=annotation,
                               time_range=SimpleNamespace(elapsed_us=lambda: end - start))  # fmt: skip

    events = [event("_paged_attention_kernel", 0, 6), event("cudaGraphLaunch", 0, 30, "DeviceType.CPU"),
              event("bench.gpu: step", 0, 100, annotation=True), event("my range", 0, 90), event("aten::mm", 0, 9,
              "DeviceType.CPU"), event("Memcpy DtoD (Device -> Device)", 10, 12)]  # fmt: skip
    rows = device_kernel_rows(events, exclude=["my range"])
    assert rows == [("_paged_attention_kernel", 6, 1), ("Memcpy DtoD (Device -> Device)", 2, 1)]


def test_cpu_op_rows_takes_operators_by_self_time():
    averages = [SimpleNamespace(key="aten::mm", self_cpu_time_total=40.0, count=3),
                SimpleNamespace(key="mkldnn::_linear_pointwise", self_cpu_time_total=10.0, count=1),
                SimpleNamespace(key="bench.gpu: step", self_cpu_time_total=5.0, count=1),
                SimpleNamespace(key="aten::linear", self_cpu_time_total=0.0, count=3)]  # fmt: skip
    assert cpu_op_rows(averages) == [("aten::mm", 40.0, 3), ("mkldnn::_linear_pointwise", 10.0, 1)]


def test_graph_timing_copies_cover_several_l2_sizes():
    l2 = 50 * 2**20
    assert graph_timing.copies(2**20, l2_bytes=l2) == graph_timing.MAX_COPIES  # small inputs: capped
    assert graph_timing.copies(100 * 2**20, l2_bytes=l2) == 2  # 3 x 50 MiB / 100 MiB, rounded up
    assert graph_timing.copies(2**30, l2_bytes=l2) == 1
    assert graph_timing.copies(4 * 2**20, max_copies=8, l2_bytes=l2) == 8
    with pytest.raises(ValueError, match="positive"):
        graph_timing.copies(0, l2_bytes=l2)


class TinyLM(nn.Module):
    def __init__(self, tied: bool):
        super().__init__()
        self.embed_tokens = nn.Embedding(10, 4)  # 40 fp32 values
        self.proj = nn.Linear(4, 4, bias=False)  # 16
        self.lm_head = nn.Linear(4, 10, bias=False)  # 40
        if tied:
            self.lm_head.weight = self.embed_tokens.weight


def test_forward_weight_bytes_counts_a_tied_embedding_once_and_an_untied_one_not_at_all():
    assert forward_weight_bytes(TinyLM(tied=True)) == (40 + 16) * 4
    # the LM head's own matrix; the embedding: a forward reads a few rows of it
    assert forward_weight_bytes(TinyLM(tied=False)) == (16 + 40) * 4
    pool = SimpleNamespace(tensors=(torch.zeros(3, 5, 16, 2, 8, dtype=torch.bfloat16),) * 2)  # (L, blocks, bs, Hkv, D)
    assert kv_token_bytes(SimpleNamespace(pool=pool)) == 2 * 3 * 2 * 8 * 2


def test_summary_section_compares_unfused_fused_and_compile():
    from bench.gpu_steps.summary import fmt, table
    from bench.gpu_steps.summary_breakdown import section_breakdown

    groups = group_kernels([("nvjet_x", 75.0, 3), ("_paged_attention_kernel", 25.0, 1)])

    def case(mode, tok_s, forward=None):
        return {"model": "m", "step": "decode", "batch": 1, "mode": mode, "forward": forward, "bound_us": 50.0,
                "gpu_over_bound": 2.0,
                "step_over_bound": 3.0, "steady": {"step_ms": 0.15, "tok_s": tok_s}, "warm_up": {"s": 9.0},
                "static": {"target": {"forwards": 1, "replays": 1, "eager_forwards": 0}},
                "source": "CUDA device events (CUPTI)", **groups}  # fmt: skip

    lines = section_breakdown({"copy": {"copy_GBps": 3000.0}, "cases": [case("cuda_graph", 200.0),
                                                                         case("compile", 100.0)]}, table, fmt)
    text = "\n".join(lines)
    assert "75% (3, 75 us)" in text and "25% (1, 25 us)" in text
    assert "| m | 1 | - | 200 | 100 | - | 0.50 |" in text  # unfused, fused, compile tok/s; their ratios to fused
    # the unfused forward's case must not replace the fused one (both are CUDA graph replays)
    cases = [case("cuda_graph", 200.0, "fused"), case("cuda_graph", 150.0, "unfused"), case("compile", 100.0)]
    text = "\n".join(section_breakdown({"copy": {"copy_GBps": 3000.0}, "cases": cases}, table, fmt))
    assert "| m | 1 | 150 | 200 | 100 | 0.75 | 0.50 |" in text
    assert section_breakdown(None, table, fmt) == []
