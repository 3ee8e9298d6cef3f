"""Kernels grouped by what they do in a decode step: pure functions over kernel (or aten op) names and times.

``classify_kernel(name)`` maps a CUDA kernel name - as CUPTI reports it, inside CUDA graphs too - to one of
``GROUPS`` by the first rule of ``RULES`` that matches (case-insensitive regular expressions, so their order
matters: attention before GEMM, because cutlass- and sm90-named attention kernels exist). Where a PyTorch kernel
name is generic (``elementwise_kernel``, ``reduce_kernel``) its full name carries the functor, which the rules read:
``silu_kernel``, ``MeanOps`` / ``rsqrt_kernel_cuda`` / ``pow_tensor_scalar`` (the torch RMSNorm), ``index_put``
(the K/V write), ``ArgMaxOps``. What no rule names - casts, adds, muls, ``cat`` (the torch rope's rotate-half),
gathers, copies, memcpy / memset - is ``other``. The same rules read aten op names (``aten::mm``, ``aten::silu``)
for the CPU dry run, coarser: the CPU reference attention's matmuls and softmax count as GEMM and sampling.

``group_kernels(rows)`` sums ``(name, microseconds, count)`` rows per group: count, microseconds, share of the total,
the share outside GEMM + attention, and the top names. ``device_kernel_rows`` / ``cpu_op_rows`` make those rows
from a ``torch.profiler`` run (device events on CUDA; aten ops by self time on CPU).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

GROUPS = ("GEMM", "attention", "norm", "rope+KV write", "activation", "sampling+verification", "other")
GEMM, ATTENTION, OTHER = GROUPS[0], GROUPS[1], GROUPS[-1]

# (group, pattern): the first match wins; nothing matched -> "other"
RULES: tuple[tuple[str, str], ...] = (
    ("attention", r"paged_attention|flash|fmha|sdpa|attention"),
    ("sampling+verification", r"softmax|top_?k|top_p|_spec_sample|_tree_sample|_block_verify|argmax|exponential|"
                              r"multinomial|sort"),  # fmt: skip
    ("norm", r"rms_?norm|layer_?norm|rsqrt|meanops|pow_tensor_scalar|aten::(mean|pow)$"),
    ("rope+KV write", r"rope|rotary|index_put|scatter(?!_gather)|_write_kv|reshape_and_cache|_kv_copy_rows"),
    ("activation", r"silu|gelu|swiglu|act_and_mul"),
    ("GEMM", r"gemm|gemv|cutlass|cublas|xmma|nvjet|wgmma|_quant_matmul|matmul|split_?k_?reduce|"
             r"(^|[_:])(mm|addmm|bmm|baddbmm|linear)(_|$)"),  # fmt: skip
)
_COMPILED = tuple((group, re.compile(pattern, re.IGNORECASE)) for group, pattern in RULES)
TOP = 15  # names listed per breakdown
_OPERATOR = re.compile(r"^\w+::\w")  # a dispatcher operator's name, e.g. aten::mm


def classify_kernel(name: str, rules: tuple[tuple[str, str], ...] | None = None) -> str:
    """The group (one of ``GROUPS``) of a CUDA kernel or aten op ``name``; ``rules`` replaces ``RULES`` (tests)."""
    compiled = _COMPILED if rules is None else tuple((g, re.compile(p, re.IGNORECASE)) for g, p in rules)
    for group, pattern in compiled:
        if pattern.search(name):
            return group
    return OTHER


def group_kernels(rows: Iterable[tuple[str, float, int]], top: int = TOP) -> dict:
    """Sum ``(name, us, count)`` rows (a name may repeat) by ``classify_kernel``.

    Returns ``{"groups": {group: {"kernels", "us", "share"}} for every group in GROUPS order, "kernels": total count,
    "us": total microseconds, "outside_gemm_attention": share of the time in neither GEMM nor attention, "top":
    [[name, group, count, us], ...] the ``top`` names by time}``; shares are 0 when nothing was timed."""
    by_name: dict[str, list] = {}
    for name, us, count in rows:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += count
        entry[1] += us
    groups = {g: {"kernels": 0, "us": 0.0, "share": 0.0} for g in GROUPS}
    for name, (count, us) in by_name.items():
        group = groups[classify_kernel(name)]
        group["kernels"] += count
        group["us"] += us
    total = sum(g["us"] for g in groups.values())
    for g in groups.values():
        g["share"] = g["us"] / total if total > 0 else 0.0
    outside = sum(g["us"] for name, g in groups.items() if name not in (GEMM, ATTENTION))
    ranked = sorted(by_name.items(), key=lambda item: -item[1][1])[:top]
    return {"groups": groups, "kernels": sum(g["kernels"] for g in groups.values()), "us": total,
            "outside_gemm_attention": outside / total if total > 0 else 0.0,
            "top": [[name, classify_kernel(name), count, us] for name, (count, us) in ranked]}  # fmt: skip


def _is_device(event) -> bool:
    return str(getattr(event, "device_type", "CPU")).endswith("CUDA")


def device_kernel_rows(events, exclude: Iterable[str] = ()) -> list[tuple[str, float, int]]:
    """``(name, us, 1)`` per GPU-side event of a ``torch.profiler`` run (``prof.events()``): kernels - those replayed
    from CUDA graphs included -, memcpy and memset; not the GPU-side copies of ``record_function`` ranges
    (``is_user_annotation``, or a name in ``exclude``)."""
    skip = set(exclude)
    return [(e.name, e.time_range.elapsed_us(), 1) for e in events
            if _is_device(e) and not getattr(e, "is_user_annotation", False) and e.name not in skip]  # fmt: skip


def cpu_op_rows(averages) -> list[tuple[str, float, int]]:
    """``(name, self us, calls)`` per operator of ``prof.key_averages()`` (``namespace::op``: ``aten::mm``,
    ``mkldnn::_linear_pointwise``, ``specdec::write_kv``; not ``record_function`` ranges), by self time so a composite
    op and the ops it calls are not counted twice (CPU)."""
    return [(a.key, a.self_cpu_time_total, a.count) for a in averages
            if _OPERATOR.match(a.key) and a.self_cpu_time_total > 0]  # fmt: skip
