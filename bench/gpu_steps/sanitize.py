"""The script the sanitizer step runs under ``compute-sanitizer --tool memcheck``: every Triton kernel once.

Paged attention as a decode over a long context at batch 1 (the split-KV / flash-decoding path, with its reduce
kernel; once with the launcher's own split count, once with an explicit one), as a batch of verification windows
with a tree mask, and as a prefill chunk next to decodes; then softmax, top-k/top-p/min-p, the inverse-CDF draw and
spec_sample; then the fused forward kernels (RMSNorm with and without the residual add, SiLU-mul, rope + paged K/V
write). Outputs are compared with the references so a kernel that reads garbage also shows up; a mismatch is
reported and the script goes on (every kernel still runs under memcheck), exiting 1 at the end. Dry run: the same
calls on CPU through the Triton interpreter (``ops.force_triton()``) with tiny shapes.
"""

from __future__ import annotations

import sys

import torch

from bench.gpu_steps.common import parse_args
from bench.kernels.bench_attention import make_inputs as attention_inputs
from bench.kernels.bench_spec_sample import make_inputs as spec_inputs
from bench.kernels.bench_spec_sample import sampling_settings, standardize_reference, verify_args
from specdec import ops
from specdec.kernels import paged_attention as pa
from specdec.kernels.inverse_cdf import sample_inverse_cdf_reference
from specdec.kernels.philox import STREAM_SAMPLE
from specdec.kernels.rms_norm import fused_add_rms_norm_reference
from specdec.kernels.rope_kv import rope_write_kv_reference
from specdec.kernels.silu_mul import silu_mul_reference
from specdec.kernels.softmax import softmax_with_temperature_reference
from specdec.kernels.spec_sample import spec_sample_reference

MISMATCHES: list[str] = []  # the checks that failed; main exits 1 at the end if any did


def check(name: str, out: torch.Tensor, ref: torch.Tensor, tol: float) -> None:
    err = (out.float() - ref.float()).abs().max().item() if out.numel() else 0.0
    status = "ok" if err <= tol else "MISMATCH"
    print(f"{name}: max abs err {err:.3g} (tol {tol:g}) {status}", flush=True)
    if status != "ok":
        MISMATCHES.append(name)


def fused_forward_kernels(dev: str, small: bool, dtype: torch.dtype, tol: float) -> None:
    """The forward's fused kernels once each, at the Llama-3.2-3B shape (tiny on CPU), against their references.
    Norm and SiLU-mul may differ from the reference by two bf16 ulp of their largest values (0.125 at 8-16); rope
    rounds as the reference does (exact)."""
    loose = tol if small else 0.13
    tokens, hidden, inter, hq, hkv, d = (3, 64, 96, 4, 2, 16) if small else (40, 3072, 8192, 24, 8, 128)
    x = torch.randn(tokens, hidden, device=dev).to(dtype)
    weight = (1 + 0.1 * torch.randn(hidden, device=dev)).to(dtype)
    residual = torch.randn(tokens, hidden, device=dev).to(dtype)
    check("rms_norm", ops.rms_norm(x, weight, 1e-5), fused_add_rms_norm_reference(x, weight, 1e-5)[0], loose)
    ref_out, ref_stream = fused_add_rms_norm_reference(x, weight, 1e-5, residual)
    out, stream = ops.add_rms_norm(x, residual.clone(), weight, 1e-5)
    check("add_rms_norm out", out, ref_out, loose)
    check("add_rms_norm stream", stream, ref_stream, 0)
    gate_up = torch.randn(tokens, 2 * inter, device=dev).to(dtype)
    check("silu_mul", ops.silu_mul(gate_up), silu_mul_reference(gate_up), loose)
    num_blocks, block_size, max_pos = (8, 4, 64) if small else (512, 16, 4096)
    qkv = torch.randn(tokens, (hq + 2 * hkv) * d, device=dev).to(dtype)
    positions = torch.randint(0, max_pos, (tokens,), device=dev)
    slots = torch.randperm(num_blocks * block_size, device=dev)[:tokens]
    freqs = torch.outer(torch.arange(max_pos, device=dev).float(),
                        1.0 / (1e4 ** (torch.arange(0, d, 2, device=dev).float() / d)))
    cos, sin = torch.cat([freqs, freqs], -1).cos().contiguous(), torch.cat([freqs, freqs], -1).sin().contiguous()
    caches = [torch.zeros(num_blocks, block_size, hkv, d, device=dev, dtype=dtype) for _ in range(4)]
    q = ops.rope_write_kv(qkv, positions, cos, sin, caches[0], caches[1], slots, hq, hkv)
    q_ref = rope_write_kv_reference(qkv, positions, cos, sin, caches[2], caches[3], slots, hq, hkv)
    check("rope_write_kv q", q, q_ref, 0 if not small else tol)
    check("rope_write_kv k cache", caches[0], caches[2], 0 if not small else tol)
    check("rope_write_kv v cache", caches[1], caches[3], 0)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(__doc__.splitlines()[0], argv)
    dev = "cuda" if torch.cuda.is_available() and not args.dry_run else "cpu"
    small = dev == "cpu"
    hq, hkv, d = (8, 2, 16) if small else (32, 8, 64)
    dtype = torch.float32 if small else torch.bfloat16
    tol = 1e-4 if small else 2e-2
    torch.manual_seed(0)
    with ops.force_triton(small):  # on CPU: the interpreter; on CUDA tensors the kernels run anyway
        # decode, batch 1, long context: split-KV path with its reduce kernel
        inputs = attention_inputs(1, 64 if small else 4096, 1, hq, hkv, d, dtype, dev)
        ref = pa.paged_attention_reference(*inputs)
        check("attention decode b1 long ctx (auto splits)", ops.paged_attention(*inputs), ref, tol)
        check("attention decode b1 long ctx (4 splits)", pa.paged_attention(*inputs, num_splits=4), ref, tol)
        # verification windows with a chain-as-tree mask, batch 4
        q_len = 5
        inputs = attention_inputs(4, 40 if small else 1024, q_len, hq, hkv, d, dtype, dev)
        mask = torch.ones(q_len, q_len, dtype=torch.bool).tril().flatten().repeat(4).to(dev)
        indptr = torch.arange(0, 4 * q_len * q_len + 1, q_len * q_len, dtype=torch.int32, device=dev)
        check("attention verify k=4 tree mask", ops.paged_attention(*inputs, mask, indptr),
              pa.paged_attention_reference(*inputs, mask, indptr), tol)  # fmt: skip
        # a prefill chunk next to two decodes (ragged batch)
        q, k_cache, v_cache, tables, _, _, scale = attention_inputs(3, 32 if small else 512, 1, hq, hkv, d, dtype,
                                                                    dev)  # fmt: skip
        q = torch.randn(34 if small else 514, hq, d, device=dev).to(dtype)
        seq_lens = torch.tensor([32 if small else 512, 20, 7], dtype=torch.int32, device=dev)
        cu = torch.tensor([0, q.shape[0] - 2, q.shape[0] - 1, q.shape[0]], dtype=torch.int32, device=dev)
        ragged = (q, k_cache, v_cache, tables, seq_lens, cu, scale)
        check("attention prefill + decodes", ops.paged_attention(*ragged), pa.paged_attention_reference(*ragged), tol)
        # sampling kernels and the fused verification
        vocab, batch, k = (300, 2, 4) if small else (128256, 8, 4)
        spec = spec_inputs(batch, k, vocab, dev)
        settings = sampling_settings(spec["target_logits"].shape[0], dev)
        probs, bad = ops.softmax_with_temperature(spec["target_logits"], settings[0])
        check("softmax", probs, softmax_with_temperature_reference(spec["target_logits"], settings[0])[0], 1e-5)
        filtered = ops.top_k_top_p_min_p(probs, *settings[1:])
        check("top_k_top_p_min_p", filtered, standardize_reference(spec["target_logits"], *settings), 1e-5)
        seeds = torch.arange(filtered.shape[0], device=dev) * 7919
        positions = torch.arange(filtered.shape[0], device=dev) + 100
        check("sample_inverse_cdf", ops.sample_inverse_cdf(filtered, seeds, positions, STREAM_SAMPLE),
              sample_inverse_cdf_reference(filtered, seeds, positions, STREAM_SAMPLE), 0)
        vargs = verify_args(spec, standardize_reference)
        out, acc = ops.spec_sample(**vargs)
        ref_out, ref_acc = spec_sample_reference(**vargs)
        check("spec_sample tokens", out, ref_out, 0)
        check("spec_sample num_accepted", acc, ref_acc, 0)
        assert not bad.any()
        fused_forward_kernels(dev, small, dtype, tol)
    if dev == "cuda":
        torch.cuda.synchronize()
    if MISMATCHES:
        print(f"kernel output differs from the reference: {', '.join(MISMATCHES)}", flush=True)
        return 1
    print("sanitize script done", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
