"""One dispatch point per op: the Triton kernel on CUDA (or when forced), the torch reference otherwise.

Rule (the dispatch contract): an op runs its Triton kernel iff its tensors are on CUDA, or ``force_triton()``
is active (used by the interpreter end-to-end test); inside ``force_reference()`` it runs its torch reference
whatever the device (so a GPU test can compare the kernel with the reference on the same device). The two
switches nest and the innermost active one wins. The choice is never inferred from ``TRITON_INTERPRET``: tests
set that process-wide, and inferring from it would push every engine test through the ~1000x slower interpreter.
"""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Iterator, Sequence

import torch

from specdec.kernels import block_verify as _block_verify
from specdec.kernels import inverse_cdf as _inverse_cdf
from specdec.kernels import kv_compact as _kv_compact
from specdec.kernels import matmul_invariant as _matmul_invariant
from specdec.kernels import paged_attention as _attention
from specdec.kernels import paged_attention_reference as _attention_reference
from specdec.kernels import rms_norm as _rms_norm
from specdec.kernels import rope_kv as _rope_kv
from specdec.kernels import silu_mul as _silu_mul
from specdec.kernels import softmax as _softmax
from specdec.kernels import spec_sample as _spec_sample
from specdec.kernels import top_k_top_p as _top_k_top_p
from specdec.kernels import tree_sample as _tree_sample
from specdec.kernels.cpu import attention as _native_attention

# None: by device (the kernel on CUDA, the reference elsewhere); "triton" / "reference": forced by the innermost
# active force_triton() / force_reference() context.
_forced: str | None = None
# False inside fused_forward(False): the forward's elementwise ops run their torch references even on CUDA.
_fuse_forward = True


@contextlib.contextmanager
def _force(mode: str | None) -> Iterator[None]:
    global _forced
    previous, _forced = _forced, mode
    try:
        yield
    finally:
        _forced = previous


def force_triton(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Run every op through its Triton launcher inside this context (on CPU that needs TRITON_INTERPRET=1).
    ``enabled=False`` restores dispatch by device inside it."""
    return _force("triton" if enabled else None)


def force_reference(enabled: bool = True) -> contextlib.AbstractContextManager[None]:
    """Run every op through its torch reference inside this context, even on CUDA tensors (the reference runs
    on the tensors' own device). ``enabled=False`` restores dispatch by device inside it."""
    return _force("reference" if enabled else None)


def use_triton(tensor: torch.Tensor) -> bool:
    """True iff the op on ``tensor`` should run its Triton kernel."""
    if _forced is not None:
        return _forced == "triton"
    return tensor.is_cuda


@contextlib.contextmanager
def fused_forward(enabled: bool) -> Iterator[None]:
    """``fused_forward(False)``: inside it the model forward's elementwise ops run their torch references even on
    CUDA - the unfused forward, so one GPU run can time both (bench.gpu's breakdown step). Other ops unaffected."""
    global _fuse_forward
    previous, _fuse_forward = _fuse_forward, enabled
    try:
        yield
    finally:
        _fuse_forward = previous


def _use_fused_kernels(x: torch.Tensor, *params: torch.Tensor) -> bool:
    """True iff the model forward's elementwise ops (norms, rope + K/V write, SiLU-mul) on ``x`` (with weights
    ``params``) should run their fused Triton kernels: ``use_triton(x)``, except inside ``fused_forward(False)``,
    while ``torch.compile`` traces (Inductor fuses the torch references itself: the two strategies the GPU benchmark
    compares) and under autograd (the kernels have no backward; EAGLE-3 head training runs the references)."""
    return (_fuse_forward and use_triton(x) and not torch.compiler.is_dynamo_compiling()
            and not (torch.is_grad_enabled() and any(t.requires_grad for t in (x, *params))))


def _norm_kernel_fits(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """The fused norm's launcher takes these (2-D, unit column stride, one dtype, a row it can hold); else the
    reference runs."""
    return (x.ndim == 2 and weight.dtype == x.dtype and x.stride(-1) == 1 and weight.is_contiguous()
            and x.shape[1] <= _rms_norm.MAX_HIDDEN)


def _launcher(module, name: str):
    """The module's Triton launcher, or a clear error if the kernel is not there."""
    fn = getattr(module, name, None)
    if fn is None:
        raise NotImplementedError(f"{module.__name__}.{name} (Triton kernel) is not available")
    return fn


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    cu_q_lens: torch.Tensor,
    scale: float,
    tree_mask: torch.Tensor | None = None,
    tree_mask_indptr: torch.Tensor | None = None,
    uniform_q_len: int | None = None,
    invariant: bool = False,
) -> torch.Tensor:
    """Paged attention; see :func:`specdec.kernels.paged_attention.paged_attention_reference` for shapes.

    ``invariant``: each query row the same bits whatever the rest of the call - on CPU the native kernel
    (``specdec.kernels.cpu.attention``; ``ValueError`` where it cannot take these tensors), on CUDA the Triton kernel
    with one launch configuration and no KV split. Ignored while dynamo traces (the CPU kernel is opaque to it).

    ``uniform_q_len``: a Python int when every sequence has exactly that many new tokens and is causal (decode,
    draft step, chain verification window). Then the op runs its static-shape, host-read-free variant
    (``paged_attention_uniform`` / ``paged_attention_uniform_reference``) - what a CUDA graph captures and
    ``torch.compile(fullgraph=True)`` traces. None (default): the general ragged path.
    """
    if invariant and not use_triton(q) and not torch.compiler.is_dynamo_compiling():
        if not (_native_attention.available() and _native_attention.supports(q, k_cache)):
            raise ValueError(f"row-invariant attention was asked for, but its CPU kernel does not take q "
                             f"{tuple(q.shape)} {q.dtype} / cache {tuple(k_cache.shape)} {k_cache.dtype} here "
                             f"(specdec.kernels.cpu.attention.supports)")
        if uniform_q_len is not None and tree_mask is not None:
            raise ValueError("uniform_q_len is for causal batches; a tree mask needs uniform_q_len=None")
        return _native_attention.paged_attention_invariant(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens,
                                                           scale, tree_mask, tree_mask_indptr)
    if uniform_q_len is not None:
        if tree_mask is not None:
            raise ValueError("uniform_q_len is for causal batches; a tree mask needs uniform_q_len=None")
        if use_triton(q):
            return _launcher(_attention, "paged_attention_uniform")(
                q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, uniform_q_len, scale, invariant=invariant)
        return _attention_reference.paged_attention_uniform_reference(
            q, k_cache, v_cache, block_tables, seq_lens, uniform_q_len, scale)
    if use_triton(q):
        return _launcher(_attention, "paged_attention")(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                                        tree_mask, tree_mask_indptr, invariant=invariant)
    return _attention.paged_attention_reference(q, k_cache, v_cache, block_tables, seq_lens, cu_q_lens, scale,
                                                tree_mask, tree_mask_indptr)


def matmul_invariant(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """``x [M, K] @ weight [N, K]^T (+ bias)`` on CUDA with one launch configuration for every M (rows
    independent of the call); see ``specdec.kernels.matmul_invariant``. CPU tensors: the fp32 reference."""
    if use_triton(x):
        return _launcher(_matmul_invariant, "matmul_invariant")(x, weight, bias)
    return _matmul_invariant.matmul_invariant_reference(x, weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm of ``x [T, hidden]`` (model dtype) with ``weight [hidden]``; see ``specdec.kernels.rms_norm``."""
    if _use_fused_kernels(x, weight) and _norm_kernel_fits(x, weight):
        return _launcher(_rms_norm, "fused_add_rms_norm")(x, weight, eps)[0]
    return _rms_norm.rms_norm_reference(x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(rms_norm(stream), stream)`` with ``stream = x + residual`` (``x`` alone when ``residual`` is None), all
    ``[T, hidden]`` in the model dtype. The fused kernel writes ``stream`` into ``residual``'s storage: use the
    returned stream, never the old ``residual``. See ``specdec.kernels.rms_norm``."""
    if (_use_fused_kernels(x, weight) and _norm_kernel_fits(x, weight)
            and (residual is None or (residual.shape == x.shape and residual.stride(-1) == 1))):
        return _launcher(_rms_norm, "fused_add_rms_norm")(x, weight, eps, residual)
    return _rms_norm.fused_add_rms_norm_reference(x, weight, eps, residual)


def silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of the fused gate/up projection ``[T, 2I] -> [T, I]``; see ``specdec.kernels.silu_mul``."""
    if _use_fused_kernels(gate_up) and gate_up.ndim == 2 and gate_up.stride(-1) == 1:
        return _launcher(_silu_mul, "silu_mul")(gate_up)
    return _silu_mul.silu_mul_reference(gate_up)


def rope_write_kv(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                  k_cache: torch.Tensor, v_cache: torch.Tensor, slot_mapping: torch.Tensor, num_heads: int,
                  num_kv_heads: int) -> torch.Tensor:
    """Rotate q and k of ``qkv [T, (Hq + 2 Hkv) * D]``, write k and v into their cache slots, return ``q [T, Hq,
    D]``; see ``specdec.kernels.rope_kv``."""
    fn = _launcher(_rope_kv, "rope_write_kv") if _use_fused_kernels(qkv) else _rope_kv.rope_write_kv_reference
    return fn(qkv, positions, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads)


def kv_compact(caches: Sequence[torch.Tensor], src_slots: torch.Tensor, dst_slots: torch.Tensor) -> None:
    """Move K/V rows ``src_slots[t] -> dst_slots[t]`` (int64 ``[N]`` flat slots, every source read before any
    destination is written) in every cache tensor of ``caches`` (e.g. ``KVPool.tensors``), in place; see
    ``specdec.kernels.kv_compact``."""
    triton_path = (isinstance(caches, (list, tuple)) and len(caches) > 0 and isinstance(caches[0], torch.Tensor)
                   and use_triton(caches[0]))
    fn = _launcher(_kv_compact, "kv_compact") if triton_path else _kv_compact.kv_compact_reference
    fn(caches, src_slots, dst_slots)


def softmax_with_temperature(logits: torch.Tensor, temperature: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(probs fp32 [R, V], bad_row bool [R])``; see the reference in ``specdec.kernels.softmax``."""
    if use_triton(logits):
        return _launcher(_softmax, "softmax_with_temperature")(logits, temperature)
    return _softmax.softmax_with_temperature_reference(logits, temperature)


def sample_inverse_cdf(weights: torch.Tensor, seeds: torch.Tensor, positions: torch.Tensor, stream: int
                       ) -> torch.Tensor:
    """One token per row of ``weights [R, V]`` by inverse CDF with its Philox uniform: int64 ``[R]``; see
    ``specdec.kernels.inverse_cdf``."""
    if use_triton(weights):
        return _launcher(_inverse_cdf, "sample_inverse_cdf")(weights, seeds, positions, stream)
    return _inverse_cdf.sample_inverse_cdf_reference(weights, seeds, positions, stream)


def top_k_top_p_min_p(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """Filtered, renormalised fp32 ``[R, V]``; see the reference in ``specdec.kernels.top_k_top_p``."""
    if use_triton(probs):
        return _launcher(_top_k_top_p, "top_k_top_p_min_p")(probs, top_k, top_p, min_p)
    return _top_k_top_p.top_k_top_p_min_p_reference(probs, top_k, top_p, min_p)


def _verification_op(module, name: str, doc: str):
    """The op ``name`` of a verification kernel module: it takes the arguments of ``module.<name>_reference``
    (positionally or by name) and runs ``module.<name>`` (the Triton launcher) iff ``use_triton(target_probs)``,
    else that reference. The three verification ops share this rule and their argument lists."""
    reference = getattr(module, f"{name}_reference")
    signature = inspect.signature(reference)

    def op(*args, **kwargs):
        target_probs = signature.bind(*args, **kwargs).arguments["target_probs"]
        fn = _launcher(module, name) if use_triton(target_probs) else reference
        return fn(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__doc__ = doc
    op.__signature__ = signature  # help() and inspect show the reference's arguments
    return op


spec_sample = _verification_op(
    _spec_sample, "spec_sample",
    """Speculative verification ``(output_token_ids int64 [B, max_k + 1], num_accepted int32 [B])``; arguments
    and layout in ``specdec.kernels.spec_sample``.""",
)  # fmt: skip
tree_sample = _verification_op(
    _tree_sample, "tree_sample",
    """Token-tree verification ``(output_token_ids int64 [B, max_depth + 1], num_accepted int32 [B],
    accepted_nodes int32 [B, max_depth])``; arguments and layout in ``specdec.kernels.tree_sample``.""",
)  # fmt: skip
block_verify = _verification_op(
    _block_verify, "block_verify",
    """Block verification (greedy and one-hot rows token-wise), same arguments and outputs as :func:`spec_sample`;
    see ``specdec.kernels.block_verify``.""",
)  # fmt: skip
