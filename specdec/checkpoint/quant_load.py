"""Quantise while loading: each linear is built, quantised and its full-precision rows dropped one module at a time,
so no full-precision copy of the model is ever held (peak: the quantised model + one fused fp32 weight; a linear of
one checkpoint tensor - o_proj, down_proj, an untied LM head - is read and quantised a chunk of rows at a time).

``load_quantized`` takes a ``LlamaForCausalLM`` still on the ``meta`` device, puts a placeholder where each linear
to quantise goes (every ``Linear``; by default not an LM head tied to the embedding, which stays unquantised since
the embedding lookup needs its rows anyway - ``quantize_lm_head=True`` gives it a quantised copy of those rows, read
from the embedding a chunk at a time once it is loaded), allocates the rest in the model dtype, then reads the
checkpoint: the parts of a linear (q/k/v, gate/up) are gathered until complete, quantised into a
``QuantizedLinear`` and freed. With a GGUF source, a Q4_0 / Q4_1 / Q8_0 tensor whose format maps exactly onto the
scheme asked for (int4 / int8 with group 32) is taken from the GGUF blocks unchanged (gguf_blocks.py); other
tensors are quantised from their dequantised values. ``quantization="gguf"`` takes every linear whose blocks map
onto one of our formats (Q4_0 / Q4_1 / Q4_K -> int4, Q8_0 / Q5_0 / Q6_K / Q5_1 / Q5_K -> int8) from the file
unchanged, and keeps the others dense in the model dtype (the file's float tensors, and Q2_K / Q3_K / ...
dequantised): the model runs the weights the file holds, nothing quantised again.

Under tensor parallelism (a model built with ``group=``) each rank quantises its own shard: every linear's slice
(``ShardLayout.slice_of``: rows of q/k/v, gate/up and the LM head, columns of o_proj and down_proj) is read and
quantised alone - the same per-row groups as the one-process quantisation, since an int4 / grouped int8 group never
straddles a shard boundary (``sharding.check_quantized_tensor_parallel``); per-channel int8 scales are the shard's
own (the max over the rank's columns of the row, docs/tensor_parallel.md). Kept GGUF blocks are sliced the same
way (``_KeptBlocks``: whole 32-wide blocks). The last LM-head shard's padding rows are zero rows.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from specdec.checkpoint.gguf_blocks import BLOCK, kept_as_stored, kept_scheme, read_blocks, unpermute_rows
from specdec.checkpoint.safetensors_reader import TensorEntry, TensorSlice
from specdec.model.linear import Linear
from specdec.model.quant.formats import dequantize, quantize_int4, quantize_int8
from specdec.model.quant.linear import DEFAULT_GROUP_SIZE, QuantizedLinear, RowStack


class _Pending(nn.Module):
    """Where a ``QuantizedLinear`` will go: the bias (allocated with the model) and the parts read so far."""

    def __init__(self, linear: Linear, num_parts: int):
        super().__init__()
        self.bias = linear.bias
        self.shape = (linear.out_features, linear.in_features)
        self.num_parts = num_parts
        # shard -> ("dense", fp32 rows) | ("kept", q, scale, offset) | ("file", a checkpoint tensor / row slice of one)
        self.parts: dict[int, tuple] = {}


@dataclass(frozen=True)
class _KeptBlocks:
    """A GGUF tensor kept quantised (``q`` int8 ``[N, K]`` or packed uint8 ``[N, K // 2]``, ``scale`` / ``offset``
    fp32 ``[N, K // group]``; offsets for int4, Q5_1 and Q5_K; groups of 16 only under "gguf", which is never
    sliced) that a tensor-parallel rank narrows like a checkpoint tensor (``ShardLayout.slice_of``): rows, or
    columns in whole 32-wide blocks."""

    q: torch.Tensor
    scale: torch.Tensor
    offset: torch.Tensor | None

    @property
    def shape(self) -> tuple[int, int]:
        return self.q.shape[0], self.q.shape[1] * (1 if self.q.dtype == torch.int8 else 2)

    def narrow(self, dim: int, start: int, length: int) -> _KeptBlocks:
        if dim == 0:
            return _KeptBlocks(*(t.narrow(0, start, length) if t is not None else None
                                 for t in (self.q, self.scale, self.offset)))
        assert self.scale.shape[1] * BLOCK == self.shape[1], "only 32-wide groups are sliced by columns"
        if start % BLOCK or length % BLOCK:
            raise ValueError(f"columns [{start}, {start + length}) cut a GGUF block of {BLOCK}")
        per_byte = 1 if self.q.dtype == torch.int8 else 2  # int4: two columns per byte
        return _KeptBlocks(self.q.narrow(1, start // per_byte, length // per_byte),
                           *(t.narrow(1, start // BLOCK, length // BLOCK) if t is not None else None
                             for t in (self.scale, self.offset)))


def _pad_rows(q: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor | None, rows: int) -> tuple:
    """``(q, scale, offset)`` with zero rows appended up to ``rows`` (what quantising zero rows gives: q 0, scale 1,
    offset 0): the padding of the last rank's LM-head shard."""
    extra = rows - q.shape[0]
    if extra <= 0:
        return q, scale, offset

    def pad(t: torch.Tensor | None, value: float) -> torch.Tensor | None:
        return None if t is None else torch.cat([t, t.new_full((extra, *t.shape[1:]), value)])

    return pad(q, 0), pad(scale, 1.0), pad(offset, 0.0)


def load_quantized(model, weights: Iterable[tuple[str, torch.Tensor | TensorEntry]], quantization: str,
                   group_size: int | None, device: torch.device, dtype: torch.dtype, cpu_path: str = "auto",
                   gguf_path: str | None = None, shared_embedding: nn.Parameter | None = None,
                   quantize_lm_head: bool | None = None) -> dict[str, int]:
    """Allocate and load the meta-device ``model`` (a ``LlamaForCausalLM``) with its linears quantised
    (``quantization`` "int8" / "int4"; None: plain linears, only the embedding shared).

    ``shared_embedding``: use this tensor as the embedding (not read from the checkpoint, no copy) - a self draft
    shares the target's. ``quantize_lm_head``: None - quantise an untied head, keep a tied one in ``dtype``; True -
    quantise the head either way (a tied head becomes a ``QuantizedLinear`` of the embedding's rows, the embedding
    itself stays for the lookup); False - never quantise the head.
    Returns counts: {"kept": linears taken from GGUF blocks unchanged, "quantized": others, and with "gguf"
    "dense": linears left in ``dtype``}.
    """
    group = group_size if group_size is not None or quantization is None else DEFAULT_GROUP_SIZE[quantization]
    as_stored = quantization == "gguf"
    if as_stored and not gguf_path:
        raise ValueError("quantization='gguf' runs a GGUF file's own blocks: pass a .gguf model (the model being "
                         "loaded - target or draft - is not one); for other checkpoints use 'int8' or 'int4'")
    gguf = _GGUFKept(gguf_path, model.config, quantization, group) if gguf_path and quantization else None
    keep = gguf.keepable_modules(model) if as_stored else None  # "gguf": the linears held as stored
    pending: dict[str, _Pending] = {}
    tied = model.config.tie_word_embeddings
    for name, module in list(model.named_modules()):
        if name == "lm_head" and (tied or quantize_lm_head is False):
            continue
        if keep is not None and name not in keep:
            continue  # "gguf": stays a dense Linear, loaded from the converted checkpoint
        if quantization is not None and isinstance(module, Linear):
            parts = 3 if name.endswith("qkv_proj") else 2 if name.endswith("gate_up_proj") else 1
            pending[name] = _Pending(module, parts)
            _set_module(model, name, pending[name])
    if shared_embedding is not None:
        model.embed_tokens.weight = nn.Parameter(torch.empty(0, device="meta"), requires_grad=False)
    model.to_empty(device=device)  # everything but the linear weights (and a shared embedding)
    model.rope.reset(device)
    if shared_embedding is not None:
        model.embed_tokens.weight = shared_embedding
    if model.config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    layout = model.layout  # a tensor-parallel rank's shard, or the whole model
    counts = {"kept": 0, "quantized": 0}
    if as_stored:
        counts["dense"] = sum(isinstance(m, Linear) and m.weight is not model.embed_tokens.weight
                              for m in model.modules())

    def finish(name: str, p: _Pending) -> None:
        kinds = {part[0] for part in p.parts.values()}
        ordered = [p.parts[i] for i in range(p.num_parts)]
        exact = kinds == {"kept"}
        if exact:
            rows = sum(t[1].shape[0] for t in ordered)
            widths = {t[1].shape[1] * (1 if t[1].dtype == torch.int8 else 2) for t in ordered}
            if rows > p.shape[0] or widths != {p.shape[1]}:
                raise ValueError(f"GGUF blocks of {name} hold {rows} x {sorted(widths)}, expected {p.shape}")
        if exact and len({(t[1].dtype, t[2].shape[1], t[3] is None) for t in ordered}) > 1:
            _set_module(model, name, _row_stack(ordered, p.bias, device, cpu_path))  # parts in different formats
            counts["kept"] += 1
            return
        if exact:
            q, scale = torch.cat([t[1] for t in ordered]), torch.cat([t[2] for t in ordered])
            offset = torch.cat([t[3] for t in ordered]) if ordered[0][3] is not None else None
            bits = 8 if q.dtype == torch.int8 else 4
            counts["kept"] += 1
        elif as_stored:
            raise AssertionError(f"{name}: quantization='gguf' reached a part that is not kept")
        else:
            if kinds == {"file"}:  # one tensor, read a chunk of rows at a time (an LM head's fp32 rows: V x hidden)
                piece = ordered[0][1]
                shape = tuple(piece.shape)
                rows_of = functools.partial(_read_rows, piece)
            else:
                dense = [t[1] if t[0] == "dense" else
                         dequantize(t[1], t[2], t[3], 8 if t[1].dtype == torch.int8 else 4) for t in ordered]
                w = dense[0] if len(dense) == 1 else torch.cat(dense)  # (N, K) fp32, this rank's shard of one module
                del dense
                shape = tuple(w.shape)
                rows_of = functools.partial(_rows, w)
                del w
            if shape[0] > p.shape[0] or shape[1] != p.shape[1]:
                raise ValueError(f"checkpoint weights of {name} have shape {shape}, expected {p.shape}")
            if group is not None and shape[1] % group:
                raise ValueError(f"quantization_group_size {group} does not divide {name}'s input width {shape[1]}")
            q, scale, offset = _quantize_rows_in_chunks(rows_of, shape[0], quantization, group)
            bits = 8 if quantization == "int8" else 4
            rows_of = None  # drops the module's fp32 rows
            counts["quantized"] += 1
        q, scale, offset = _pad_rows(q, scale, offset, p.shape[0])  # the last LM-head shard's padding rows
        bias = p.bias.detach() if p.bias is not None else None
        ql = QuantizedLinear(q.to(device), scale.to(device), offset.to(device) if offset is not None else None,
                             bits, bias, exact_scales=exact and as_stored)  # "gguf": never int4pack's bf16
        ql.prepare(device, cpu_path)
        _set_module(model, name, ql)
        if (counts["kept"] + counts["quantized"]) % _TRIM_EVERY == 0:  # glibc keeps freed temporaries otherwise
            _release_freed_heap()

    def rest() -> Iterator[tuple[str, torch.Tensor | TensorEntry]]:
        for hf_name, source in weights:
            name = hf_name.removeprefix("model.")
            if shared_embedding is not None and name == "embed_tokens.weight":
                yield hf_name, shared_embedding  # a copy onto itself: nothing to read
                continue
            module_name, shard = _linear_of(model, name)
            if module_name is None or module_name not in pending or not name.endswith(".weight"):
                yield hf_name, source
                continue
            p = pending[module_name]
            kept = gguf.read(hf_name) if gguf is not None else None
            if kept is not None:
                kept = layout.slice_of(hf_name, _KeptBlocks(*kept))  # this rank's rows / blocks
                p.parts[shard] = ("kept", kept.q, kept.scale, kept.offset)
            else:
                piece = layout.slice_of(hf_name, source)  # this rank's rows / columns (the whole tensor at size 1)
                if p.num_parts == 1 and _reads_rows(piece):
                    p.parts[shard] = ("file", piece)  # read while quantising, a chunk of rows at a time
                else:
                    dense = piece if isinstance(piece, torch.Tensor) else piece.read()
                    p.parts[shard] = ("dense", dense.float())
            if len(p.parts) == p.num_parts:
                finish(module_name, pending.pop(module_name))

    model.load_weights(rest())
    if pending:
        raise ValueError(f"checkpoint is missing linear weights: {sorted(pending)[:8]}")
    if tied and quantize_lm_head and quantization is not None and not as_stored:
        embedding = model.embed_tokens.weight.detach()  # (V, H) in dtype: quantised a chunk of rows at a time
        q, scale, offset = _quantize_rows_in_chunks(functools.partial(_rows, embedding), embedding.shape[0],
                                                    quantization, group)
        head = QuantizedLinear(q, scale, offset, 8 if quantization == "int8" else 4)
        head.prepare(device, cpu_path)
        model.lm_head = head
        counts["quantized"] += 1
    _release_freed_heap()
    model.quant_counts = counts  # how the linears were made (bench / tests read it)
    return counts


def _row_stack(parts: list[tuple], bias: torch.Tensor | None, device: torch.device, cpu_path: str) -> RowStack:
    """Kept parts ``("kept", q, scale, offset)`` of one fused linear in different formats, each its own
    ``QuantizedLinear`` on its rows (the fused bias split to match)."""
    linears, row = [], 0
    for _, q, scale, offset in parts:
        rows = q.shape[0]
        part_bias = bias.detach()[row : row + rows] if bias is not None else None
        ql = QuantizedLinear(q.to(device), scale.to(device), offset.to(device) if offset is not None else None,
                             8 if q.dtype == torch.int8 else 4, part_bias, exact_scales=True)
        ql.prepare(device, cpu_path)
        linears.append(ql)
        row += rows
    return RowStack(linears)


_TRIM_EVERY = 8  # modules quantised between two returns of the freed heap to the OS (each return costs ~0.1 s)
_CHUNK_ROWS = 2048  # rows quantised at a time: per-row schemes, so chunking is exact and caps the temporaries


def _quantize_rows_in_chunks(rows_of, num_rows: int, quantization: str, group: int | None) -> tuple:
    """``quantize_int8`` / ``quantize_int4`` of a weight ``[num_rows, K]``, ``_CHUNK_ROWS`` rows at a time (same
    result: every scale belongs to one row), so the fp32 temporaries stay small beside the module's weight.
    ``rows_of(start, n)``: rows ``[start, start + n)`` (a view of a tensor in memory, or read from the file).
    Each chunk's result is written into outputs allocated once (no concatenated copy of the quantised weight)."""
    out: list[torch.Tensor | None] | None = None  # q, scale, offset (None for int8)
    for start in range(0, num_rows, _CHUNK_ROWS):
        n = min(_CHUNK_ROWS, num_rows - start)
        chunk = rows_of(start, n).float()  # (n, K) fp32
        part = (*quantize_int8(chunk, group), None) if quantization == "int8" else quantize_int4(chunk, group)
        if out is None:
            out = [None if t is None else t.new_empty((num_rows, *t.shape[1:])) for t in part]
        for dest, t in zip(out, part):
            if dest is not None:
                dest[start : start + n] = t
    return tuple(out)


def _rows(w: torch.Tensor, start: int, n: int) -> torch.Tensor:
    return w[start : start + n]


def _reads_rows(piece) -> bool:
    """``piece`` (a checkpoint tensor or a rank's slice of one) can be read a chunk of rows at a time: a whole
    ``TensorEntry`` or a row slice (a column slice reads whole rows of the file for its columns anyway)."""
    return isinstance(piece, TensorEntry) or (isinstance(piece, TensorSlice) and piece.dim == 0)


def _read_rows(piece: TensorEntry | TensorSlice, start: int, n: int) -> torch.Tensor:
    """Rows ``[start, start + n)`` of ``piece`` (``_reads_rows``), read from the file in the stored dtype."""
    if isinstance(piece, TensorEntry):
        return piece.narrow(0, start, n).read()
    return TensorSlice(piece.entry, 0, piece.start + start, n).read()


def _release_freed_heap() -> None:
    """Give the loader's freed temporaries back to the OS (glibc keeps freed heap pages otherwise, and the process's
    resident set stays at the loading peak). A no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _linear_of(model, name: str) -> tuple[str | None, int]:
    """(module name, shard) of an HF parameter name (``layers.0.self_attn.k_proj.weight`` -> qkv_proj, 1)."""
    for fragment, (fused, shard) in model._FUSED.items():
        if f".{fragment}." in name:
            return name.replace(fragment, fused).rsplit(".", 1)[0], shard
    return name.rsplit(".", 1)[0] if "." in name else None, 0


def _set_module(model: nn.Module, name: str, module: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, module)


class _GGUFKept:
    """The GGUF tensors kept as stored, by HF name (see gguf_blocks.py): those that map exactly onto the scheme
    asked for ("int4" / "int8" with group 32), or with "gguf" every type of ``gguf_blocks.KEPT``."""

    def __init__(self, path: str, config, quantization: str, group_size: int | None):
        from specdec.checkpoint.gguf import _hf_name, open_gguf

        self.tensors = {}
        self.weights: list[str] = []  # HF names of every 2-D weight but the embedding (what "gguf" decides over)
        for t in open_gguf(path).tensors:
            if not (t.name.endswith(".weight") and len(t.shape) == 2) or t.name == "token_embd.weight":
                continue
            name, type_name = _hf_name(t.name), t.tensor_type.name
            self.weights.append(name)
            if quantization == "gguf":
                keep = kept_as_stored(type_name)
            else:  # GGUF's blocks are 32 wide: another group size needs requantising
                keep = group_size == 32 and kept_scheme(type_name) == quantization
            if keep:
                self.tensors[name] = t
        self.heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        self.permuted = config.model_type == "llama"  # llama.cpp permutes llama's Q/K rows for its rope

    def keepable_modules(self, model) -> set[str]:
        """The linears of ``model`` whose parts are all kept: "gguf" holds them as stored (a fused linear whose
        parts differ in format - q/k Q4_K with v Q6_K - as a ``RowStack``)."""
        kept: dict[str, dict[int, bool]] = {}  # module -> shard -> held as stored
        for hf_name in self.weights:
            module, shard = _linear_of(model, hf_name.removeprefix("model."))
            kept.setdefault(module, {})[shard] = hf_name in self.tensors
        keep = set()
        for module, parts in kept.items():
            expected = 3 if module.endswith("qkv_proj") else 2 if module.endswith("gate_up_proj") else 1
            if len(parts) == expected and all(parts.values()):
                keep.add(module)
        return keep

    def read(self, hf_name: str) -> tuple | None:
        tensor = self.tensors.get(hf_name)
        if tensor is None:
            return None
        q, scale, offset = read_blocks(tensor)
        kind = hf_name.split(".")[-2]
        if self.permuted and kind in self.heads:
            q, scale, offset = (unpermute_rows(t, self.heads[kind]) for t in (q, scale, offset))
        return q, scale, offset
