"""``QuantizedLinear``: a linear layer whose weight is held int8 / int4 (specdec/model/quant/formats.py), and
``quantize_linears`` which puts it in place of a model's ``Linear``s.

Which arithmetic runs is fixed when the module is prepared for its device (``prepare``), never per call, so the
model's output for a row does not depend on how many rows a forward has (decode vs k+1-row verification):

- ``"weight_only"`` (CUDA, or CPU where no fast path applies): ``x @ dequant(W).T`` with fp32 products and
  accumulation - the Triton kernel on CUDA (kernels/quant_matmul.py), its torch reference elsewhere.
- ``"w8a8"`` (CPU, int8 per-channel): int8 weights times per-row dynamic int8 activations - activations are
  quantised too (specdec/model/quant/cpu_paths.py) - run by specdec's C kernel (native.py, ``backend "native"``)
  where it builds, else by oneDNN's int8 GEMM (``backend "onednn"``): the same arithmetic, bit for bit.
- ``"w4a8"`` (CPU with AVX-512 VNNI and a C compiler, int4 with a group that is a multiple of 32): the C kernel of
  specdec/model/quant/native.py - int4 weights times per-block int8 activations, each weight read once for 16 rows.
- ``"w8g"`` (the same CPUs, int8 in groups of 16 or of a multiple of 32 - GGUF's Q8_0 / Q5_0 / Q6_K kept as
  stored): native.py's grouped int8 kernel - int8 weights times per-block int8 activations, as w4a8.
- ``"int4pack"`` (CPU, int4 with group 32/64/128/256, where w4a8 is unavailable): torch's
  ``_weight_int4pack_mm_for_cpu`` in bf16.

docs/guarantees.md says what each means for losslessness: the target is the model as loaded, with its path.
"""

from __future__ import annotations

import torch
from torch import nn

from specdec import ops
from specdec.kernels.quant_matmul import quant_matmul, quant_matmul_reference
from specdec.model.linear import Linear
from specdec.model.quant import cpu_paths, native
from specdec.model.quant.formats import BITS, quantize_int4, quantize_int8, unpack_int4

# "gguf": a GGUF model's linears in the formats its file stores them in (specdec/checkpoint/gguf_blocks.py)
QUANTIZATIONS = ("int8", "int4", "gguf")
DEFAULT_GROUP_SIZE = {"int8": None, "int4": 32, "gguf": None}  # int8 per channel; int4 per 32 inputs (GGUF's block)
# "torch": torch's / oneDNN's CPU kernels only, not specdec's native ones (int4pack for int4, oneDNN for w8a8)
CPU_PATHS = ("auto", "weight_only", "torch")


def check_quantization(quantization: object, group_size: object, what: str = "quantization") -> None:
    """``ValueError`` unless ``quantization`` is None / "int8" / "int4" / "gguf" and ``group_size`` is None or an
    integer >= 2 (even for int4; None for gguf, whose groups are the file's); None means the scheme's default (int8:
    per channel, int4: 32)."""
    if quantization is not None and quantization not in QUANTIZATIONS:
        raise ValueError(f"{what} must be None, 'int8', 'int4' or 'gguf' (a GGUF's own blocks), got {quantization!r}")
    if group_size is None:
        return
    if quantization is None:
        raise ValueError(f"{what}_group_size={group_size!r} given without {what}")
    if quantization == "gguf":
        raise ValueError(f"{what}='gguf' keeps the file's own groups: {what}_group_size must be None, "
                         f"got {group_size!r}")
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 or (
            quantization == "int4" and group_size % 2):
        raise ValueError(f"{what}_group_size must be None (int8: per channel, int4: 32) or an integer >= 2 (even for "
                         f"int4) dividing every linear's input width, got {group_size!r}")


def check_quantize_lm_head(value: object, quantization: object, what: str = "quantize_lm_head") -> None:
    """``ValueError`` unless ``value`` is None (quantise an untied head, keep a tied one), True (quantise the head,
    a tied one as its own copy beside the embedding) or False (never), and True comes with a quantization."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{what} must be None, True or False, got {value!r}")
    if value is True and quantization is None:
        raise ValueError(f"{what}=True needs a quantization scheme ('int8' or 'int4') to quantise the head with")
    if value is True and quantization == "gguf":
        raise ValueError(f"{what}=True with quantization='gguf': the head runs as the file stores it (an untied "
                         f"head's blocks; a tied head is the embedding); use 'int8' or 'int4' to quantise it")


class QuantizedLinear(nn.Module):
    """``y = x @ dequant(W).T + bias`` for ``x [..., in_features]`` (fp32 / bf16 / fp16) -> ``[..., out_features]``
    in ``x``'s dtype. Buffers: ``qweight`` (int8 ``[N, K]`` or packed uint8 ``[N, K // 2]``), ``scale`` fp32
    ``[N, G]``, ``offset`` fp32 ``[N, G]`` (int4) or None; ``bias`` a parameter in the model dtype or None.
    ``exact_scales``: the scales are a file's own (kept GGUF blocks) and every path must multiply by them exactly
    (w4a8 then holds them in fp32 where fp16 cannot)."""

    def __init__(self, qweight: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, bits: int,
                 bias: torch.Tensor | None = None, exact_scales: bool = False):
        super().__init__()
        assert bits in (4, 8), f"bits must be 4 or 8, got {bits}"
        self.bits = bits
        self.out_features = qweight.shape[0]
        self.in_features = qweight.shape[1] * (2 if bits == 4 else 1)
        self.group_size = self.in_features // scale.shape[1]
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", scale)
        self.register_buffer("offset", offset)
        self.bias = nn.Parameter(bias, requires_grad=False) if bias is not None else None
        self.path = "weight_only"  # see the module docstring; set by prepare()
        self.backend: str | None = None  # w8a8 only: "native" (specdec's C kernel) or "onednn"
        self.bias_fp32: torch.Tensor | None = None  # the native kernels' bias, converted once in prepare()
        self.state: tuple | None = None  # the CPU path's tensors (oneDNN / int4pack formats)
        self.released = False  # qweight / scale / offset were replaced by the CPU path's copies
        self.exact_scales = exact_scales

    @classmethod
    def from_weight(cls, weight: torch.Tensor, bias: torch.Tensor | None, quantization: str,
                    group_size: int | None = None) -> QuantizedLinear:
        """Quantise ``weight [N, K]`` (any float dtype): "int8" symmetric per channel (or per group), "int4"
        asymmetric per group of ``group_size`` (default 32) input columns."""
        check_quantization(quantization, group_size)
        if quantization == "gguf":
            raise ValueError("quantization='gguf' keeps a GGUF file's own blocks while loading a .gguf model; "
                             "a weight in memory is quantised with 'int8' or 'int4'")
        g = group_size if group_size is not None else DEFAULT_GROUP_SIZE[quantization]
        if quantization == "int8":
            q, scale = quantize_int8(weight, g)
            return cls(q, scale, None, 8, bias)
        q, scale, offset = quantize_int4(weight, g)
        return cls(q, scale, offset, 4, bias)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, bits={self.bits}, "
                f"group_size={self.group_size}, path={self.path}" + (f" ({self.backend})" if self.backend else ""))

    def dequantize(self) -> torch.Tensor:
        """The weight as fp32 ``[N, K]`` (``ValueError`` once a CPU path replaced the quantised tensors)."""
        from specdec.model.quant.formats import dequantize

        if self.released:
            raise ValueError("this QuantizedLinear's tensors were replaced by its CPU path's packed copies")
        return dequantize(self.qweight, self.scale, self.offset, self.bits)

    def prepare(self, device: torch.device, cpu_path: str = "auto", release: bool = True) -> None:
        """Fix the arithmetic for ``device``: on CPU with ``cpu_path="auto"`` the fast path that applies ("w8a8"
        for per-channel int8 - specdec's kernel, else oneDNN's -, "w8g" for grouped int8, "w4a8" or else "int4pack"
        for int4 with a supported group; never int4pack for ``exact_scales``), else "weight_only";
        ``cpu_path="torch"`` passes over specdec's native kernels. ``release``: the CPU path's packed copies replace
        ``qweight`` / ``scale`` / ``offset`` (meta tensors), so they are held once."""
        if cpu_path not in CPU_PATHS:
            raise ValueError(f"cpu_path must be one of {CPU_PATHS}, got {cpu_path!r}")
        if self.released:
            return
        self.path, self.state, self.backend, self.bias_fp32 = "weight_only", None, None, None
        if torch.device(device).type != "cpu" or cpu_path == "weight_only":
            return
        native_ok = cpu_path == "auto" and native.available()
        per_channel = self.bits == 8 and self.scale.shape[1] == 1 and self.offset is None
        if per_channel and native_ok and native.supports_w8a8(self.out_features, self.in_features):
            self.path, self.backend, self.state = "w8a8", "native", native.pack_w8a8(self.qweight, self.scale)
        elif per_channel and cpu_paths.w8a8_available():
            self.path, self.backend = "w8a8", "onednn"
            self.state = cpu_paths.w8a8_prepare(self.qweight, self.scale)
        elif self.bits == 8 and native_ok and native.supports_w8g(self.out_features, self.in_features,
                                                                  self.group_size, self.offset is not None):
            self.path = "w8g"
            self.state = native.pack_w8g(self.qweight, self.scale, self.offset)
        elif (self.bits == 4 and cpu_path == "auto" and native.supports(self.out_features, self.in_features,
                                                                        self.group_size)
              and (self.exact_scales or native.fits_fp16(self.scale, self.offset)) and native.available()):
            self.path = "w4a8"
            self.state = native.pack_w4a8(unpack_int4(self.qweight), self.scale, self.offset, self.exact_scales)
        elif (self.bits == 4 and self.group_size in cpu_paths.INT4PACK_GROUP_SIZES and self.out_features % 16 == 0
              and not self.exact_scales and cpu_paths.int4pack_available()):  # int4pack rounds scales to bf16
            self.path = "int4pack"
            self.state = cpu_paths.int4pack_prepare(unpack_int4(self.qweight), self.scale, self.offset)
        if self.bias is not None and (self.path in ("w4a8", "w8g") or self.backend == "native"):
            self.bias_fp32 = self.bias.detach().float().contiguous()  # the model dtype's bias, fp32 (no copy if fp32)
        if self.path != "weight_only" and release:
            for name in ("qweight", "scale", "offset"):
                t = getattr(self, name)
                if t is not None:
                    setattr(self, name, torch.empty_like(t, device="meta"))
            self.released = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x2 = x.reshape(-1, self.in_features)  # (M, K)
        if self.path == "w8a8" and self.backend == "native":
            out = native.w8a8_linear(x2, self.state, self.bias_fp32, out_dtype=x.dtype)
        elif self.path == "w8a8":
            out = cpu_paths.w8a8_linear(x2, self.state, self.bias).to(x.dtype)
        elif self.path == "w4a8":
            out = native.w4a8_linear(x2, self.state, self.group_size, self.bias_fp32, out_dtype=x.dtype)
        elif self.path == "w8g":
            out = native.w8g_linear(x2, self.state, self.group_size, self.bias_fp32, out_dtype=x.dtype)
        elif self.path == "int4pack":
            out = cpu_paths.int4pack_linear(x2, self.state, self.group_size, self.bias).to(x.dtype)
        elif ops.use_triton(x2):
            out = quant_matmul(x2.contiguous(), self.qweight, self.scale, self.offset, self.bias, self.bits)
        else:
            out = quant_matmul_reference(x2, self.qweight, self.scale, self.offset, self.bias, self.bits)
        return out.view(*x.shape[:-1], self.out_features)

    def path_reference(self, x: torch.Tensor) -> torch.Tensor:
        """fp32 ``[M, N]``: the torch reference of the arithmetic ``self.path`` runs (before the cast to ``x``'s
        dtype), for tests. Needs the quantised tensors (prepare with ``release=False``)."""
        if self.path == "w8a8":
            return cpu_paths.w8a8_reference(x, self.qweight, self.scale, self.bias)
        if self.path == "w4a8":
            return native.w4a8_reference(x, unpack_int4(self.qweight), self.scale, self.offset, self.bias,
                                         self.exact_scales)
        if self.path == "w8g":
            return native.w8g_reference(x, self.qweight, self.scale, self.bias, self.offset)
        if self.path == "int4pack":
            return cpu_paths.int4pack_reference(x, unpack_int4(self.qweight), self.state[1], self.group_size,
                                                self.bias)
        return quant_matmul_reference(x.float(), self.qweight, self.scale, self.offset, self.bias, self.bits)

    def held_bytes(self) -> int:
        """Bytes this module holds for its weight (the CPU path's copies, or the quantised tensors) and bias."""
        tensors = list(self.state) if self.state is not None else []
        tensors += [t for t in (self.qweight, self.scale, self.offset) if t is not None and t.device.type != "meta"]
        if self.bias is not None:
            tensors.append(self.bias)
        return sum(_nbytes(t) for t in tensors)


class RowStack(nn.Module):
    """A fused linear (q/k/v, gate/up) whose parts are held in different formats - a GGUF with q/k in Q4_K and v in
    Q6_K, under ``quantization="gguf"``: ``y = cat([part(x) for part in parts], -1)``, each part a
    ``QuantizedLinear`` on its own rows. A row's output depends on that row only, as each part's does."""

    def __init__(self, parts: list[QuantizedLinear]):
        super().__init__()
        self.parts = nn.ModuleList(parts)
        self.in_features = parts[0].in_features
        self.out_features = sum(p.out_features for p in parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(x) for part in self.parts], dim=-1)


def _nbytes(t: torch.Tensor) -> int:
    try:
        return t.numel() * t.element_size()
    except RuntimeError:  # an opaque oneDNN tensor
        return t.untyped_storage().nbytes()


def quantize_linears(model: nn.Module, quantization: str, group_size: int | None = None,
                     device: torch.device | str = "cpu", cpu_path: str = "auto", release: bool = True) -> int:
    """Replace every ``Linear`` of ``model`` by a ``QuantizedLinear`` (prepared for ``device``), except one whose
    weight is shared with another module (an LM head tied to the embedding keeps the embedding's rows, unquantised).
    Returns how many were replaced. Each plain weight is dropped as soon as its replacement exists."""
    check_quantization(quantization, group_size)
    holders: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            holders[id(param)] = holders.get(id(param), 0) + 1
    replaced = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if not isinstance(child, Linear) or holders.get(id(child.weight), 0) > 1:
                continue
            if child.weight_released:
                raise ValueError("quantize_linears needs plain weights: load the model with prepack_weights=False")
            q = QuantizedLinear.from_weight(child.weight.detach(), _detached(child.bias), quantization, group_size)
            q.prepare(torch.device(device), cpu_path, release)
            setattr(parent, name, q)
            replaced += 1
    return replaced


def _detached(bias: torch.Tensor | None) -> torch.Tensor | None:
    return bias.detach().clone() if bias is not None else None


def bits_of(quantization: str) -> int:
    return BITS[quantization]
