"""GPU-readiness of the sampling kernels (softmax, top-k/top-p, inverse-CDF draw): compile them for sm_80 / sm_90
exactly as the launchers would.

The block size and warp count come from the launchers' own config functions (``softmax_config`` /
``top_k_top_p_config``) at real vocabulary sizes, so this checks the configurations that actually run. Both
kernels hold one fixed-size chunk of a row at a time, so the same config also serves consumer GPUs (sm_86/89):
shared memory is checked against their 99 KiB limit, not the 160+ KiB of A100/H100.
Run with ``-s`` to see the resource table.
"""

from gpu_compile import CompileJob, compile_reports, format_table, make_signature, pointer_args

from specdec.kernels import inverse_cdf, softmax, top_k_top_p

VOCABS = {"SmolLM2": 49152, "Llama-3.2": 128256, "Qwen2.5": 151936}
ARCHS = (80, 90)
SHARED_LIMIT = 99 * 1024  # sm_86/89 per-block opt-in limit (sm_80: 163 KiB, sm_90: 227 KiB)


def _divisible(signature: dict[str, str], vocab: int) -> tuple[str, ...]:
    """Arguments a real launch specialises as 16-divisible: torch pointers, and vocab / strides when V % 16 == 0."""
    scalars = tuple(name for name in signature if name == "vocab" or name.endswith("_stride"))
    return pointer_args(signature) + (scalars if vocab % 16 == 0 else ())


def _jobs() -> list[tuple[dict, CompileJob]]:
    """(table labels, compile job) for every kernel x vocab x arch (x logits dtype for the softmax)."""
    jobs = []
    for vocab in VOCABS.values():
        for arch in ARCHS:
            cfg = softmax.softmax_config(vocab)
            constexprs = {"BLOCK": cfg.block}
            for dtype in ("fp32", "bf16", "fp16"):
                types = {"logits_ptr": f"*{dtype}", "bad_row_ptr": "*i1"}
                sig = make_signature(softmax._softmax_temperature_kernel, constexprs, "*fp32", types)
                job = CompileJob(
                    "specdec.kernels.softmax",
                    "_softmax_temperature_kernel",
                    sig,
                    constexprs,
                    num_warps=cfg.num_warps,
                    arch=arch,
                    divisible_by_16=_divisible(sig, vocab),
                )
                jobs.append(({"op": "softmax", "vocab": vocab, "dtype": dtype}, job))
            cfg = top_k_top_p.top_k_top_p_config(vocab)
            constexprs = {"MASS_SCALE": top_k_top_p.MASS_SCALE, "BLOCK": cfg.block}
            sig = make_signature(top_k_top_p._top_k_top_p_min_p_kernel, constexprs, "*fp32", {"top_k_ptr": "*i64"})
            job = CompileJob(
                "specdec.kernels.top_k_top_p",
                "_top_k_top_p_min_p_kernel",
                sig,
                constexprs,
                num_warps=cfg.num_warps,
                arch=arch,
                divisible_by_16=_divisible(sig, vocab),
            )
            jobs.append(({"op": "top_k_top_p", "vocab": vocab, "dtype": "fp32"}, job))
            constexprs = {"CHUNK": inverse_cdf.CDF_CHUNK}
            sig = make_signature(inverse_cdf._sample_inverse_cdf_kernel, constexprs, "*fp32",
                                 {"seeds_ptr": "*i64", "positions_ptr": "*i64", "out_ptr": "*i64"})
            job = CompileJob("specdec.kernels.inverse_cdf", "_sample_inverse_cdf_kernel", sig, constexprs,
                             num_warps=4, arch=arch, divisible_by_16=_divisible(sig, vocab))
            jobs.append(({"op": "inverse_cdf", "vocab": vocab, "dtype": "fp32"}, job))
    return jobs


def test_sampling_kernels_compile_without_spills() -> None:
    labelled = _jobs()
    # NOTE: vocab is a runtime argument, so vocab sizes with the same config are one (deduplicated) compile;
    # copy each report before labelling it.
    reports = compile_reports([job for _, job in labelled], workers=2)
    reports = [{**report, **labels} for report, (labels, _) in zip(reports, labelled)]
    print()
    print(format_table(reports, ["op", "vocab", "dtype", "BLOCK"]))
    for report in reports:
        where = f"{report['op']} vocab={report['vocab']} {report['dtype']} sm_{report['arch']}"
        assert report["error"] is None, f"{where}:\n{report['error']}"
        assert report["spill_stores"] == 0 and report["spill_loads"] == 0, f"{where} spills: {report}"
        assert report["shared"] <= SHARED_LIMIT, f"{where} needs {report['shared']} B of shared memory"
