"""Batch-invariant CPU kernels for a loaded model (``LLM(batch_invariant=...)``, issue 33).

Greedy speculative decoding equals plain greedy decoding only if a verification window's row computes, bit for bit,
what the decode it replaces computes. oneDNN's bf16 GEMM and torch's SDPA pick their blocking - and so their
rounding - by the number of rows and the window's shape, so in bfloat16 they do not (docs/guarantees.md). With this
mode on, every bf16 ``Linear`` runs ``specdec.kernels.cpu.gemm`` (each output row computed alone, fixed order) and
every attention layer ``specdec.kernels.cpu.attention`` (each query row over its keys in position order); norms,
rope and the activation are per-row torch operations already, and the int8 / int4 native kernels are row-invariant.

``batch_invariant``: None (the default) turns it on where it is not slower than the kernels it replaces at decode
and verification sizes - a CPU with AMX-BF16, a bfloat16 model, a C compiler (measured in
bench/experiments/20261128_invariant); True asks for it wherever it can run (``ValueError`` elsewhere: on a GPU, in
float32, without AVX512_BF16); False never.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec.kernels._triton import HAS_TRITON
from specdec.kernels.cpu import attention as native_attention
from specdec.kernels.cpu import gemm
from specdec.model.linear import Linear


def supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the invariant kernels can run: a CPU with AVX512_BF16 and a bfloat16 model; a CUDA device with
    Triton (fp32 / fp16 / bf16)."""
    device = torch.device(device)
    if device.type == "cuda":
        return dtype in (torch.float32, torch.float16, torch.bfloat16) and HAS_TRITON
    return device.type == "cpu" and dtype == torch.bfloat16 and gemm.available() and native_attention.available()


def check_option(batch_invariant: object, dtype: torch.dtype, device: torch.device) -> None:
    """``ValueError`` unless ``batch_invariant`` is None / False, or True where ``supported``."""
    if batch_invariant not in (None, True, False):
        raise ValueError(f"batch_invariant must be None (where it is not slower), True or False, got "
                         f"{batch_invariant!r}")
    if batch_invariant and not supported(dtype, torch.device(device)):
        raise ValueError(f"batch_invariant=True needs a bfloat16 model on a CPU with AVX512_BF16 and a C compiler "
                         f"(specdec's row-invariant kernels), or a CUDA device with Triton; got {dtype} on "
                         f"{torch.device(device).type} (float32 CPU linears run MKL)")


def resolve(batch_invariant: bool | None, dtype: torch.dtype, device: torch.device) -> bool:
    """Whether the invariant kernels run for this option, dtype and device (None: on CPUs where AMX runs the GEMM;
    never on GPUs, where their cost is unmeasured)."""
    if batch_invariant is False or not supported(dtype, torch.device(device)):
        return False
    if torch.device(device).type == "cuda":
        return batch_invariant is True
    return batch_invariant is True or gemm.backend() == "amx"


def unsupported_attention(model: nn.Module) -> str | None:
    """Why the invariant attention cannot take ``model``'s head layout (None: it can; the CUDA kernel takes every
    layout the model does)."""
    if any(p.is_cuda for p in model.parameters()):
        return None
    for module in model.modules():
        if hasattr(module, "batch_invariant") and hasattr(module, "head_dim"):
            if not native_attention.supports_shape(module.head_dim, module.num_heads, module.num_kv_heads):
                return (f"the row-invariant attention takes a head dim that is a multiple of 16 up to 256 and at most "
                        f"16 query heads per KV head; this model has head dim {module.head_dim}, "
                        f"{module.num_heads} query and {module.num_kv_heads} KV heads")
    return None


def enable(model: nn.Module, release_weights: bool = True) -> None:
    """Run ``model``'s bf16 ``Linear``s through the row-invariant GEMM and its attention layers through the
    row-invariant attention. ``release_weights``: each linear's plain weight is replaced by the packed one, except a
    weight shared with another module (a tied LM head keeps the embedding's rows)."""
    holders: dict[int, int] = {}  # id(parameter) -> how many modules hold it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    on_gpu = any(p.is_cuda for p in model.parameters())
    for module in model.modules():
        if isinstance(module, Linear) and on_gpu:
            module.invariant_cuda = True  # the Triton GEMM with one configuration for every row count
        elif isinstance(module, Linear) and not module.weight_released and module.weight.dtype == torch.bfloat16:
            module.pack_invariant(release_weight=release_weights and holders.get(id(module.weight), 0) <= 1)
        if hasattr(module, "batch_invariant"):
            module.batch_invariant = True
