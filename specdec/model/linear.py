"""``Linear``: ``nn.Linear`` with an optional oneDNN-prepacked copy of its weight for CPU float32 / bfloat16.

Why: speculative decoding pays off only if the target's forward over a k+1-token window costs about what a
one-token decode costs (the layer is weight-bandwidth bound either way). On CPU, MKL's float32 GEMM
(``F.linear``) does not keep that promise: on an Intel Xeon it held for up to 3 rows, then switched to a path
that repacks the whole weight on every call (SmolLM2-135M, 1 thread: the LM head 13 ms for 1-3 rows, 26-45 ms
for 4-8; a forward over 5 tokens 1.6x a decode step); on an AMD EPYC it scales with the rows from 2 on (Qwen2.5
1.5B shapes, 1 thread: an 8960 x 1536 linear 4.4 ms for 1 row, 9.0 for 2, 12.9 for 3; the 151936-row LM head 67,
144, 211 ms). oneDNN's prepacked weights (the format ``torch.compile``'s CPU freezing uses) cost the same for 1 to
16 rows (4-5 ms and 47-73 ms there) but carry a small fixed overhead per call, which loses for one row. So a
float32 ``Linear`` that keeps its plain weight (a tied LM head, or ``prepack_linears(release_weights=False)``)
uses ``F.linear`` for one row (decode) and the packed copy from ``PREPACK_MIN_ROWS`` = 2 rows up (verification
windows, batched decode, prefill); one whose plain weight was released (the default, below) uses the packed copy
for every row - on the Xeon that costs ~0.06 ms per call at 2-3 rows,
on the EPYC it makes a 2-token window cost what a 5-token one does instead of 3x.

bfloat16 is different: ``F.linear`` in bf16 goes through oneDNN without a packed weight and reorders it on
every call, for any row count (SmolLM2's LM head: 7.4 ms for 1 row, 10.3 ms for 5, 11.7 ms for 8), while the
packed bf16 copy costs 4.5-5.6 ms for 1 to 5 rows and is faster than ``F.linear`` at every row count measured
(1..20) on every SmolLM2 and Qwen2.5-0.5B shape. So a bfloat16 ``Linear`` uses its packed copy from one row up
(``PREPACK_MIN_ROWS_BF16``). It is offered only on CPUs with native bf16 (avx512_bf16 or AMX): elsewhere oneDNN
emulates bf16 and float32 is the fast dtype (see ``resolve_dtype``'s CPU policy).

Under ``LLM(batch_invariant=...)`` (on by default where AMX runs it, ``specdec/model/batch_invariant.py``) a
bfloat16 ``Linear`` runs a row-invariant GEMM of specdec's own instead (``pack_invariant``,
``specdec.kernels.cpu.gemm``): every output row is the same bit for bit whatever the number of rows.

The packed copy replaces the plain weight (``prepack(release_weight=True)``, what ``prepack_linears`` does): the
``weight`` parameter becomes a ``meta`` tensor of the same shape and dtype and every row count goes through the
packed copy, so a model's linears take their weights' bytes once (issue 19: a kept plain copy doubled them).
The one exception is a weight shared with another module (an LM head tied to the embedding: the lookup needs the
plain rows), which keeps both. The price is float32 decode: one row through the packed copy instead of
``F.linear`` - measured in docs/benchmarks.md ("Footprint"). ``LLM(prepack_weights=False)`` keeps plain weights
and ``F.linear`` (``torch.compile``'s static forward needs them). The packed copy is a plain attribute, not a
parameter or buffer: it is not in ``state_dict`` and is never moved between devices (CPU only).
"""

from __future__ import annotations

import functools
import logging

import torch
from torch import nn

from specdec import ops
from specdec.kernels.cpu.gemm import gemm_bf16, pack_bf16
from specdec.memory import available_memory_bytes

logger = logging.getLogger(__name__)

PREPACK_MIN_ROWS = 2  # float32: F.linear below this many rows, the prepacked weight from here up
PREPACK_MIN_ROWS_BF16 = 1  # bfloat16: the prepacked weight for every row count (F.linear reorders per call)
_PACK_BATCH_HINT = 8  # the row count oneDNN tunes the packed layout for (measured: good for 4..16 rows)


def dynamo_tracing() -> bool:
    """Dynamo is tracing the calling code (``torch.compile``); False in eager code.

    Not ``torch.compiler.is_compiling()``: in torch 2.13 that is one flag for the whole process, True in every
    thread while any thread compiles (kernels/philox.py compiles its CPU noise in a background thread), so eager
    forwards in the main thread took the compile-only paths meanwhile - with released weights, a ``RuntimeError``.
    """
    return torch.compiler.is_dynamo_compiling()


class Linear(nn.Linear):
    """``nn.Linear`` for inputs ``x: [..., in_features]`` that uses ``packed_weight`` when it is set and either the
    plain weight was released or ``x`` has ``>= PREPACK_MIN_ROWS`` rows (float32) / ``>= PREPACK_MIN_ROWS_BF16``
    (bfloat16). Output ``[..., out_features]`` in ``x``'s dtype either way; ``x`` must have the weight's dtype."""

    packed_weight: torch.Tensor | None = None  # oneDNN-layout copy of ``weight``, set by ``prepack()``
    invariant_weight: torch.Tensor | None = None  # row-invariant GEMM's copy (``pack_invariant()``): used first
    invariant_cuda: bool = False  # CUDA: the Triton GEMM with one configuration for every row count
    packed_bf16: bool = False  # the packed copy is bfloat16: use it for every row count
    weight_released: bool = False  # ``weight`` is a meta tensor: the packed copy is the only one

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: under torch.compile the plain F.linear: Inductor lowers mkldnn._linear_pointwise only for weights
        # it packed itself (graph constants, "freezing"), so our packed copy fails to compile; with
        # ``options={"freezing": True}`` Inductor packs F.linear's weight the same way (specdec/runner/cuda_graphs.py).
        if self.invariant_cuda and x.is_cuda:
            x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, in_features)
            return ops.matmul_invariant(x2, self.weight, self.bias).view(*x.shape[:-1], self.out_features)
        if self.invariant_weight is not None and not dynamo_tracing():
            if x.dtype != torch.bfloat16:
                raise ValueError(f"this Linear runs the bf16 row-invariant GEMM; its input must be bfloat16, not "
                                 f"{x.dtype}")
            x2 = x.reshape(-1, x.shape[-1])  # (M, in_features)
            out = gemm_bf16(x2, self.invariant_weight, self.out_features, self.bias, x.dtype)
            return out.view(*x.shape[:-1], self.out_features)
        if self.packed_weight is not None and not dynamo_tracing():
            rows = x.shape[0] if x.dim() == 2 else None
            if self.weight_released or (rows is not None and rows >= (
                    PREPACK_MIN_ROWS_BF16 if self.packed_bf16 else PREPACK_MIN_ROWS)):
                x2 = x.reshape(-1, x.shape[-1]).contiguous()  # (M, in_features)
                out = torch.ops.mkldnn._linear_pointwise(x2, self.packed_weight, self.bias, "none", [], "")
                return out.view(*x.shape[:-1], self.out_features)
        if self.weight_released:
            raise RuntimeError("this Linear's plain weight was released for its prepacked copy, which torch.compile "
                               "cannot trace; load the model with prepack_weights=False to compile it")
        return nn.functional.linear(x, self.weight, self.bias)

    def prepack(self, release_weight: bool = False) -> None:
        """Build the packed copy from the current ``weight`` (call again after changing the weight).
        ``release_weight``: replace ``weight`` by a ``meta`` tensor of its shape and dtype, so the packed copy is
        the only one held (it is then used for every row count and ``unpack`` is refused)."""
        if self.weight_released:
            raise ValueError("prepack() after the plain weight was released: there is no weight to pack again")
        weight = self.weight.detach()
        if weight.dtype not in (torch.float32, torch.bfloat16):
            raise ValueError(f"prepack supports float32 and bfloat16 weights, not {weight.dtype}")
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight, _PACK_BATCH_HINT)
        self.packed_bf16 = weight.dtype == torch.bfloat16
        self.invariant_weight = None  # the oneDNN copy replaces a row-invariant one
        if release_weight:
            self.weight = nn.Parameter(torch.empty_like(weight, device="meta"), requires_grad=False)
            self.weight_released = True

    @property
    def packed_copy(self) -> torch.Tensor | None:
        """The packed copy forward uses (the row-invariant GEMM's or oneDNN's), None without one."""
        return self.invariant_weight if self.invariant_weight is not None else self.packed_weight

    def pack_invariant(self, release_weight: bool = False) -> None:
        """Run this bf16 linear through the row-invariant GEMM (``specdec.kernels.cpu.gemm``): each output row the
        same bit for bit whatever the number of rows (docs/guarantees.md). Replaces a oneDNN packed copy;
        ``release_weight`` as in ``prepack``."""
        if self.weight_released:
            raise ValueError("pack_invariant() after the plain weight was released: there is no weight to pack")
        if self.weight.dtype != torch.bfloat16:
            raise ValueError(f"the row-invariant GEMM takes bfloat16 weights, not {self.weight.dtype}")
        self.invariant_weight = pack_bf16(self.weight.detach())
        self.packed_weight, self.packed_bf16 = None, False
        if release_weight:
            self.weight = nn.Parameter(torch.empty_like(self.weight, device="meta"), requires_grad=False)
            self.weight_released = True

    def unpack(self) -> None:
        """Drop the packed copy and go back to ``F.linear`` (``ValueError`` if the plain weight was released)."""
        if self.weight_released:
            raise ValueError("unpack() after the plain weight was released for the packed copy; load the model with "
                             "prepack_weights=False to keep plain weights")
        self.packed_weight = None
        self.packed_bf16 = False
        self.invariant_weight = None


@functools.cache
def cpu_has_native_bf16() -> bool:
    """True on CPUs with bf16 arithmetic in hardware (avx512_bf16 or AMX) where this torch's oneDNN uses it."""
    def probe(name: str) -> bool:
        fn = getattr(torch.cpu, name, None)
        try:
            return bool(fn()) if fn is not None else False
        except Exception:  # noqa: BLE001 - a probe that fails means "not known to be there"
            return False

    if not (probe("_is_avx512_bf16_supported") or probe("_is_amx_tile_supported")):
        return False
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        return False


def prepack_supported(dtype: torch.dtype, device: torch.device) -> bool:
    """True where the packed path exists and measured faster: CPU, a torch built with oneDNN, and float32, or
    bfloat16 on a CPU with native bf16 (``cpu_has_native_bf16``)."""
    if device.type != "cpu" or dtype not in (torch.float32, torch.bfloat16):
        return False
    if not (torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")):
        return False
    return dtype == torch.float32 or cpu_has_native_bf16()


def check_prepack_option(prepack_weights: object, dtype: torch.dtype, device: torch.device) -> None:
    """``ValueError`` unless ``prepack_weights`` is None / False, or True where ``prepack_supported``."""
    if prepack_weights not in (None, True, False):
        raise ValueError(f"prepack_weights must be None (where supported), True or False, got {prepack_weights!r}")
    if prepack_weights and not prepack_supported(dtype, device):
        raise ValueError(f"prepack_weights=True needs a CPU float32 model (or bfloat16 on a CPU with native bf16) and "
                         f"a torch with oneDNN; got {dtype} on {device} (use None for 'where supported', or False)")


def prepack_linears(model: nn.Module, required: bool = False, release_weights: bool = True) -> int:
    """Prepack every ``Linear`` of ``model``; returns the bytes the packed copies add to what the model holds.

    ``release_weights`` (the default): each packed copy replaces its plain weight (``Linear.prepack``), one linear
    at a time, so packing adds nothing beyond the largest weight while it runs - except for a weight shared with
    another module (a tied LM head), which keeps its plain rows and adds a copy. ``release_weights=False`` keeps
    every plain weight (the copies double the linears' bytes); then ``required=False`` (the "auto" setting) skips,
    with a warning, when the copies would take more than half of the available memory (``MemAvailable``), and
    ``required=True`` packs regardless.
    """
    linears = [m for m in model.modules() if isinstance(m, Linear)]
    holders: dict[int, int] = {}  # id(parameter) -> how many modules hold it directly
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    shared = [m for m in linears if holders.get(id(m.weight), 0) > 1]
    kept = linears if not release_weights else shared
    added = sum(m.weight.numel() * m.weight.element_size() for m in kept)
    available = available_memory_bytes()
    if not release_weights and not required and available is not None and 2 * added > available:
        logger.warning("not prepacking linear weights (LLM(prepack_weights=None)): the copies would take %.1f GB "
                       "of %.1f GB available; verification windows will be slower on this CPU",
                       added / 1e9, available / 1e9)
        return 0
    for m in linears:
        m.prepack(release_weight=release_weights and not any(m is k for k in shared))
    return added
