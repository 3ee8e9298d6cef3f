"""Why rope_write_kv differs from its torch reference on an H200 (1 ulp in ~17% of bf16/fp16 elements, tests.log of
bench/results/gpu_h200_20261128_tests) while the interpreter is exact: four variants of the rotation, each against
the rounding it claims, on the device given (cuda) and in fp16/bf16.

  MODE 0: the shipped formulation - round(round(x1*c) + round(-x2*s)), c, s rounded to the dtype first
  MODE 1: the same with the fp32 products forced through memory-free bit rounding (bf16 only: RNE by integer ops)
  MODE 2: one rounding - round(x1*c - x2*s) in fp32, c, s rounded to the dtype (products exact: FMA-invariant)
Each is launched with and without enable_fp_fusion. Usage: python probe.py [cuda|cpu]
"""
import sys

import torch

import triton
import triton.language as tl


@triton.jit
def _rot(x_ptr, c_ptr, s_ptr, out_ptr, HALF: tl.constexpr, MODE: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    d = tl.arange(0, HALF)
    dtype = out_ptr.dtype.element_ty
    c1 = tl.load(c_ptr + row * 2 * HALF + d).to(dtype).to(tl.float32)
    s1 = tl.load(s_ptr + row * 2 * HALF + d).to(dtype).to(tl.float32)
    x1 = tl.load(x_ptr + row * 2 * HALF + d).to(tl.float32)
    x2 = tl.load(x_ptr + row * 2 * HALF + HALF + d).to(tl.float32)
    if MODE == 0:
        out = ((x1 * c1).to(dtype).to(tl.float32) + (-x2 * s1).to(dtype).to(tl.float32)).to(dtype)
    elif MODE == 1:
        a = (x1 * c1).to(tl.uint32, bitcast=True)
        b = (-x2 * s1).to(tl.uint32, bitcast=True)
        a = ((a + 0x7FFF + ((a >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        b = ((b + 0x7FFF + ((b >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
        out = (a + b).to(dtype)
    else:
        out = (x1 * c1 - x2 * s1).to(dtype)
    tl.store(out_ptr + row * HALF + d, out)


def reference(x, c, s, mode):
    half = x.shape[1] // 2
    x1, x2 = x[:, :half], x[:, half:]
    c1, s1 = c[:, :half].to(x.dtype), s[:, :half].to(x.dtype)
    if mode in (0, 1):
        return x1 * c1 + (-x2) * s1  # torch rounds each op to the dtype
    return (x1.float() * c1.float() - x2.float() * s1.float()).to(x.dtype)


def main():
    device = sys.argv[1] if len(sys.argv) > 1 else "cuda"
    g = torch.Generator().manual_seed(0)
    rows, half = 4096, 32
    for dtype in (torch.float16, torch.bfloat16):
        x = torch.randn(rows, 2 * half, generator=g).to(dtype)
        ang = torch.rand(rows, 2 * half, generator=g) * 100
        c, s = ang.cos().contiguous(), ang.sin().contiguous()
        for mode in (0, 1, 2):
            if mode == 1 and dtype != torch.bfloat16:
                continue
            ref = reference(x, c, s, mode)
            for fusion in (True, False):
                out = torch.empty(rows, half, dtype=dtype, device=device)
                kwargs = {} if device == "cpu" else {"enable_fp_fusion": fusion}
                _rot[(rows,)](x.to(device), c.to(device), s.to(device), out, HALF=half, MODE=mode, **kwargs)
                bad = (out.cpu() != ref).sum().item()
                print(f"{device} {str(dtype):15} mode {mode} fp_fusion {fusion!s:5}: {bad} / {ref.numel()} differ",
                      flush=True)
                if device == "cpu":
                    break


if __name__ == "__main__":
    main()
