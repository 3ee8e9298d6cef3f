"""Turn a GGUF checkpoint (llama.cpp's format) into a Hugging Face-style model directory.

Over 300 lines because the format's three concerns stay together - metadata -> config.json (with the checks that
refuse what is not supported), tensors -> safetensors (name map, Q/K un-permutation, dequantisation), and the
atomic directory write - while the tokenizer lives in ``specdec/tokenizer/gguf_tokenizer.py``.

The result (`config.json`, `model.safetensors` or shards plus an index, `tokenizer.json`,
`tokenizer_config.json`, `generation_config.json`) is read by any HF-format loader, ours and
transformers' alike, so GGUF support stops here and never leaks into the model code.

    model = load_gguf("SmolLM2-135M-Instruct.Q4_1.gguf")        # config, state_dict, tokenizer, ...
    convert_gguf("SmolLM2-135M-Instruct.Q4_1.gguf", "out/dir")  # the same, written to disk atomically

Supported: architectures `llama` and `qwen2` with a byte-level BPE vocabulary whose pre-tokenizer
(`tokenizer.ggml.pre`) is `llama-bpe`, `smollm` or `qwen2`, or a SentencePiece BPE vocabulary
(`tokenizer.ggml.model = "llama"`, Mistral-7B's): specdec/tokenizer/gguf_tokenizer.py. Anything else raises
`ValueError` naming what is supported.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import shutil
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from safetensors.torch import save_file
from tqdm.auto import tqdm

from specdec.model.config import GGUF_CONVERSION_RECORD
from specdec.tokenizer.gguf_tokenizer import build_tokenizer

if TYPE_CHECKING:
    from gguf import GGUFReader, ReaderTensor

SUPPORTED_ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
MAX_SHARD_BYTES = 2 * 1024**3
CONVERSION_RECORD = GGUF_CONVERSION_RECORD  # provenance of a converted directory (source file, hash, dtype)
CONVERTER_VERSION = 1  # bump when the output of `convert_gguf` changes, so caches convert again

_GGUF_MAGIC = b"GGUF"
_PROGRESS_MIN_BYTES = 256 * 1024**2  # show a dequantisation progress bar for files larger than this
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_TENSOR_RE = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")


@dataclass
class GGUFModel:
    """A GGUF checkpoint in Hugging Face form: what `convert_gguf` writes, held in memory."""

    config: dict[str, Any]  # config.json
    state_dict: dict[str, torch.Tensor]  # HF parameter names; `lm_head.weight` only when not tied
    tokenizer_json: str  # a serialised `tokenizers.Tokenizer` (tokenizer.json)
    tokenizer_config: dict[str, Any]  # tokenizer_config.json, with the chat template
    generation_config: dict[str, Any]  # generation_config.json: bos / eos / pad ids


# ----------------------------------------------------------------------------------------------------------------
# Reading


def open_gguf(path: str | os.PathLike) -> GGUFReader:
    """Open a GGUF file for reading (memory-mapped), with clear errors for a missing or non-GGUF file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file not found: {path}")
    try:
        with path.open("rb") as f:
            magic = f.read(4)
    except OSError as e:  # e.g. no read permission
        raise ValueError(f"cannot read GGUF file {path}: {e.strerror or e}") from e
    if magic != _GGUF_MAGIC:
        raise ValueError(f"{path} is not a GGUF file (magic {magic!r}, expected {_GGUF_MAGIC!r})")
    try:
        import gguf
    except ImportError as e:  # an optional dependency: `pip install specdec[gguf]`
        raise ImportError("reading GGUF files needs the `gguf` package: pip install 'specdec[gguf]'") from e
    return gguf.GGUFReader(path)


class _Metadata:
    """Typed access to a reader's key-value metadata; float32 values come back as their shortest decimal."""

    _MISSING = object()

    def __init__(self, reader: GGUFReader, path: str | os.PathLike):
        self._fields, self._path = reader.fields, path

    def get(self, key: str, default: Any = None) -> Any:
        from gguf import GGUFValueType

        field = self._fields.get(key)
        if field is None:
            return default
        value = field.contents()
        if field.types == [GGUFValueType.FLOAT32]:
            # NOTE: 9.999999747378752e-06 -> 1e-05, as the upstream config.json has it; same float32 either way.
            value = float(str(np.float32(value)))
        return value

    def require(self, key: str) -> Any:
        value = self.get(key, self._MISSING)
        if value is self._MISSING:
            raise ValueError(f"{self._path}: required GGUF metadata key {key!r} is missing")
        return value


def _architecture(md: _Metadata) -> str:
    arch = md.require("general.architecture")
    if arch not in SUPPORTED_ARCHITECTURES:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {sorted(SUPPORTED_ARCHITECTURES)}")
    return arch


def _rope_scaling(md: _Metadata, arch: str) -> dict[str, Any] | None:
    """HF `rope_scaling` from `{arch}.rope.scaling.*` (GGUF has no llama3 keys: a `rope_freqs` tensor instead, read
    by `llama3_scaling_from_rope_freqs`)."""
    kind = md.get(f"{arch}.rope.scaling.type", "none")
    if kind == "none":
        return None
    if kind not in ("linear", "yarn"):
        raise ValueError(f"unsupported rope scaling type {kind!r}; supported: 'none', 'linear', 'yarn'")
    scaling = {"rope_type": kind, "factor": md.require(f"{arch}.rope.scaling.factor")}
    if kind == "yarn":
        scaling["original_max_position_embeddings"] = md.require(f"{arch}.rope.scaling.original_context_length")
        for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
            if (value := md.get(f"{arch}.rope.scaling.{key}")) is not None:
                scaling[hf_key] = value
    return scaling


def _build_config(md: _Metadata, arch: str, vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    hidden, heads = md.require(f"{arch}.embedding_length"), md.require(f"{arch}.attention.head_count")
    head_dim = md.get(f"{arch}.attention.key_length", hidden // heads)
    rope_dim = md.get(f"{arch}.rope.dimension_count", head_dim)
    if rope_dim != head_dim:
        raise ValueError(f"partial rotary embeddings (rope dim {rope_dim} != head dim {head_dim}) are not supported")
    config = {
        "architectures": [SUPPORTED_ARCHITECTURES[arch]],
        "model_type": arch,
        "vocab_size": vocab_size,  # from the token list, which the embedding rows must match
        "hidden_size": hidden,
        "intermediate_size": md.require(f"{arch}.feed_forward_length"),
        "num_hidden_layers": md.require(f"{arch}.block_count"),
        "num_attention_heads": heads,
        "num_key_value_heads": md.get(f"{arch}.attention.head_count_kv", heads),  # GGUF spec: absent = MHA
        "head_dim": head_dim,
        "hidden_act": "silu",
        "rms_norm_eps": md.require(f"{arch}.attention.layer_norm_rms_epsilon"),
        "rope_theta": md.require(f"{arch}.rope.freq_base"),  # never defaulted: a wrong theta is silent
        "rope_scaling": _rope_scaling(md, arch),
        "max_position_embeddings": md.require(f"{arch}.context_length"),
        "tie_word_embeddings": tied,
        "torch_dtype": dtype,
    }
    if arch == "llama":
        config.update(attention_bias=False, mlp_bias=False)
    return config


# ----------------------------------------------------------------------------------------------------------------
# Tensors


def _hf_name(gguf_name: str) -> str:
    if gguf_name in _GLOBAL_TENSORS:
        return _GLOBAL_TENSORS[gguf_name]
    match = _BLOCK_TENSOR_RE.fullmatch(gguf_name)
    if match and match[2] in _BLOCK_TENSORS:
        return f"model.layers.{match[1]}.{_BLOCK_TENSORS[match[2]]}.{match[3]}"
    raise ValueError(f"unexpected GGUF tensor {gguf_name!r}")


ROPE_FREQS = "rope_freqs.weight"  # llama.cpp's per-frequency rope divisors (Llama 3.1+): read into the config


def _weights(reader: GGUFReader) -> list[ReaderTensor]:
    """The tensors that are model weights (not ``rope_freqs``)."""
    return [t for t in reader.tensors if t.name != ROPE_FREQS]


def llama3_scaling_from_rope_freqs(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """HF's llama3 ``rope_scaling`` that gives exactly llama.cpp's ``rope_freqs`` (float32 ``[head_dim // 2]``: each
    frequency is divided by its entry), or None when every entry is 1. llama.cpp's converter writes the tensor from
    the HF parameters (``factor``, ``low_freq_factor``, ``high_freq_factor``, ``original_max_position_embeddings``);
    ``factor`` is the largest divisor and the others are searched over the values released models use. ``ValueError``
    when no llama3 scaling reproduces the tensor (to 1e-4)."""
    divisors = np.asarray(divisors, dtype=np.float64)
    if divisors.shape != (head_dim // 2,):
        raise ValueError(f"rope_freqs.weight has shape {list(divisors.shape)}, expected [{head_dim // 2}]")
    if np.allclose(divisors, 1.0):
        return None
    factor = float(divisors.max())
    inv_freq = 1.0 / theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim)
    wavelen = 2 * math.pi / inv_freq
    # Llama 3.1 / 3.2's (8192, 1, 4) first; with few frequencies several sets give the same divisors - any does
    candidates = [(8192, 1.0, 4.0)] + [(2 ** e, low, high) for e in range(4, 22) for low in (1.0, 0.5, 2.0, 4.0)
                                       for high in (4.0, 2.0, 8.0, 16.0, 32.0) if high > low]
    for original, low, high in candidates:
        smooth = (original / wavelen - low) / (high - low)
        expected = np.where(wavelen < original / high, 1.0,
                            np.where(wavelen > original / low, factor, 1.0 / ((1 - smooth) / factor + smooth)))
        if np.allclose(expected, divisors, rtol=1e-4, atol=0):
            return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
                    "original_max_position_embeddings": original}
    raise ValueError(f"rope_freqs.weight (largest divisor {factor:g}) matches no llama3 rope scaling; other "
                     "per-frequency rope factors are not supported")


def _expected_shapes(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """HF parameter name -> torch shape `[out, in]` of every tensor the checkpoint must hold."""
    d, hd, ffn = config["hidden_size"], config["head_dim"], config["intermediate_size"]
    q, kv = config["num_attention_heads"] * hd, config["num_key_value_heads"] * hd
    layer = {
        "input_layernorm.weight": (d,),
        "post_attention_layernorm.weight": (d,),
        "self_attn.q_proj.weight": (q, d),
        "self_attn.k_proj.weight": (kv, d),
        "self_attn.v_proj.weight": (kv, d),
        "self_attn.o_proj.weight": (d, q),
        "mlp.gate_proj.weight": (ffn, d),
        "mlp.up_proj.weight": (ffn, d),
        "mlp.down_proj.weight": (d, ffn),
    }
    if config["model_type"] == "qwen2":
        layer.update({"self_attn.q_proj.bias": (q,), "self_attn.k_proj.bias": (kv,), "self_attn.v_proj.bias": (kv,)})
    shapes = {"model.embed_tokens.weight": (config["vocab_size"], d), "model.norm.weight": (d,)}
    if not config["tie_word_embeddings"]:
        shapes["lm_head.weight"] = (config["vocab_size"], d)
    for i in range(config["num_hidden_layers"]):
        shapes.update({f"model.layers.{i}.{name}": shape for name, shape in layer.items()})
    return shapes


def _check_tensors(reader: GGUFReader, config: dict[str, Any]) -> None:
    """Fail before any dequantisation if a tensor is missing, unexpected or of the wrong shape."""
    expected = _expected_shapes(config)
    found = {_hf_name(t.name): tuple(int(n) for n in reversed(t.shape)) for t in _weights(reader)}
    if missing := sorted(expected.keys() - found.keys()):
        raise ValueError(f"GGUF is missing tensors (HF names): {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if extra := sorted(found.keys() - expected.keys()):
        raise ValueError(f"GGUF has tensors this {config['model_type']} config does not use: {extra[:8]}")
    for name, shape in found.items():
        if shape != expected[name]:
            raise ValueError(f"tensor {name} has shape {list(shape)}, config implies {list(expected[name])}")


def _unpermute_rope(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (interleaved rope pairs -> HF `rotate_half` halves)."""
    head_dim = w.shape[0] // n_head
    # (n_head, 2, hd/2, ...) was stored as (n_head, hd/2, 2, ...): swap the pair axis back.
    return w.reshape(n_head, head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _dequantize(tensor: ReaderTensor) -> torch.Tensor:
    """One GGUF tensor as float32 in torch layout: GGUF shapes are `[in, out]`, torch's `[out, in]`."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize

    array = dequantize(tensor.data, tensor.tensor_type)  # float32; a fresh array except for F32 ...
    if tensor.tensor_type == GGMLQuantizationType.F32:
        array = array.copy()  # ... which is a read-only view of the memory-mapped file
    return torch.from_numpy(array.reshape(tuple(int(n) for n in reversed(tensor.shape))))


def iter_hf_tensors(
    reader: GGUFReader, config: dict[str, Any], dtype: str = "float32", progress: bool | None = None
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(hf_name, tensor)` one at a time, dequantised, un-permuted and cast to `dtype`.

    Memory stays at about one tensor, so a multi-GB checkpoint converts without holding it whole.
    `progress`: True shows a tqdm bar over the tensors on stderr, False none, None only for files over
    256 MiB; the bar hides itself when stderr is not a terminal.
    """
    heads = {"attn_q": config["num_attention_heads"], "attn_k": config["num_key_value_heads"]}
    disable = None if _show_progress(reader, progress) else True  # None: tqdm hides itself off a terminal
    with tqdm(_weights(reader), unit="tensor", desc="converting", disable=disable, leave=False) as bar:
        for tensor in bar:
            weight = _dequantize(tensor)
            kind = tensor.name.split(".")[-2]
            if config["model_type"] == "llama" and kind in heads:  # only llama GGUFs are rope-permuted
                weight = _unpermute_rope(weight, heads[kind])
            yield _hf_name(tensor.name), weight.to(DTYPES[dtype]).contiguous()


def _show_progress(reader: GGUFReader, progress: bool | None) -> bool:
    """`progress` as asked; None = only for files whose tensors exceed 256 MiB."""
    if progress is not None:
        return progress
    return sum(int(t.n_bytes) for t in reader.tensors) > _PROGRESS_MIN_BYTES


# ----------------------------------------------------------------------------------------------------------------
# Public API


def _read_header(path: str | os.PathLike, dtype: str) -> tuple[GGUFReader, GGUFModel]:
    """Open and validate `path`; everything but the weights (`state_dict` is left empty)."""
    if dtype not in DTYPES:
        raise ValueError(f"unsupported dtype {dtype!r}; supported: {list(DTYPES)}")
    reader = open_gguf(path)
    md = _Metadata(reader, path)
    if md.get("split.count", 1) > 1:
        raise ValueError(f"{path} is one shard of a split GGUF; merge it first (llama-gguf-split --merge)")
    arch = _architecture(md)
    tokenizer, tokenizer_config, generation_config = build_tokenizer(md, arch)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = _build_config(md, arch, len(md.require("tokenizer.ggml.tokens")), tied, dtype)
    freqs = next((t for t in reader.tensors if t.name == ROPE_FREQS), None)
    if freqs is not None:
        if config["rope_scaling"] is not None:
            raise ValueError(f"{path} has both {config['rope_scaling']['rope_type']} rope scaling and rope_freqs")
        config["rope_scaling"] = llama3_scaling_from_rope_freqs(_dequantize(freqs).numpy(), config["rope_theta"],
                                                                config["head_dim"])
    # NOTE: every eos in config.json too (as Llama-3.1's has), so a loader that reads only config.json still stops.
    config["bos_token_id"] = generation_config["bos_token_id"]
    config["eos_token_id"] = generation_config["eos_token_id"]
    _check_tensors(reader, config)
    return reader, GGUFModel(config, {}, tokenizer.to_str(), tokenizer_config, generation_config)


def load_gguf(path: str | os.PathLike, dtype: str = "float32", progress: bool | None = None) -> GGUFModel:
    """Read a GGUF checkpoint into HF form in memory (`dtype`: "float32", "bfloat16" or "float16")."""
    reader, model = _read_header(path, dtype)
    model.state_dict = dict(iter_hf_tensors(reader, model.config, dtype, progress))
    return model


def convert_gguf(
    path: str | os.PathLike,
    out_dir: str | os.PathLike,
    dtype: str = "float32",
    *,
    overwrite: bool = False,
    source_sha256: str | None = None,
    max_shard_bytes: int = MAX_SHARD_BYTES,
    progress: bool | None = None,
) -> Path:
    """Write a GGUF checkpoint as an HF model directory at `out_dir`; returns it.

    Atomic: everything is written into a hidden sibling temp directory that is renamed to `out_dir` only
    when complete, so an interrupted convert never leaves a directory that looks finished. Weights go to
    `model.safetensors`, or to shards of at most `max_shard_bytes` plus `model.safetensors.index.json`.
    `source_sha256` (when the caller verified the file) is recorded in `specdec_conversion.json`.
    `progress=True` announces the conversion on stderr (one line) and shows a bar over the tensors; the
    default (None) stays quiet except for a bar on files over 256 MiB.
    Raises `FileNotFoundError` if `path` does not exist, `FileExistsError` if `out_dir` exists (and is not an
    empty directory) and `overwrite` is false, `ValueError` for a file that is not a supported GGUF.
    """
    out_dir = Path(out_dir)
    if out_dir.exists() and not overwrite and not _is_empty_dir(out_dir):
        raise FileExistsError(f"{out_dir} already exists and is not empty (pass overwrite=True to replace it)")
    reader, model = _read_header(path, dtype)
    if progress:
        print(f"specdec: converting {path} to {out_dir} (once; {len(reader.tensors)} tensors)", file=sys.stderr)
    with _atomic_directory(out_dir) as tmp:
        _write_json(tmp / "config.json", model.config)
        _write_json(tmp / "generation_config.json", model.generation_config)
        _write_json(tmp / "tokenizer_config.json", model.tokenizer_config)
        (tmp / "tokenizer.json").write_text(model.tokenizer_json, encoding="utf-8")
        _write_safetensors(iter_hf_tensors(reader, model.config, dtype, progress), tmp, max_shard_bytes)
        record = {"source": Path(path).name, "source_sha256": source_sha256, "dtype": dtype}
        _write_json(tmp / CONVERSION_RECORD, {**record, "converter_version": CONVERTER_VERSION})
    return out_dir


def _is_empty_dir(path: Path) -> bool:
    return path.is_dir() and not any(path.iterdir())


def read_conversion_record(out_dir: str | os.PathLike) -> dict[str, Any] | None:
    """The provenance `convert_gguf` wrote into `out_dir`, or None if it is not a converted directory."""
    try:
        return json.loads((Path(out_dir) / CONVERSION_RECORD).read_text())
    except (FileNotFoundError, NotADirectoryError, json.JSONDecodeError):
        return None


# ----------------------------------------------------------------------------------------------------------------
# Writing


def _write_json(path: Path, obj: dict[str, Any]) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def _write_safetensors(tensors: Iterator[tuple[str, torch.Tensor]], out_dir: Path, max_shard_bytes: int) -> None:
    """Stream tensors into shards of at most `max_shard_bytes` (one file and no index when they fit in one)."""
    shards: list[list[str]] = []
    current: dict[str, torch.Tensor] = {}
    size = 0

    def flush() -> None:
        nonlocal current, size
        save_file(current, str(out_dir / f"shard-{len(shards):05d}.tmp"), metadata={"format": "pt"})
        shards.append(list(current))
        current, size = {}, 0

    total = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if current and size + nbytes > max_shard_bytes:
            flush()
        current[name], size, total = tensor, size + nbytes, total + nbytes
    if current:
        flush()
    if len(shards) == 1:
        files = ["model.safetensors"]
    else:
        files = [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for i, file in enumerate(files):
        (out_dir / f"shard-{i:05d}.tmp").rename(out_dir / file)
        (out_dir / file).chmod(_default_file_mode())  # safetensors creates 0600 files; match the JSON files
    if len(shards) == 1:
        return
    weight_map = {name: file for names, file in zip(shards, files) for name in names}
    _write_json(out_dir / "model.safetensors.index.json", {"metadata": {"total_size": total}, "weight_map": weight_map})


def _default_file_mode() -> int:
    """What `open()` creates under the process umask (which has no getter: set it and put it back)."""
    umask = os.umask(0o022)
    os.umask(umask)
    return 0o666 & ~umask


def _unique_sibling(path: Path, tag: str) -> Path:
    """Create a hidden empty directory next to `path` (permissions from the umask, unlike `mkdtemp`'s 0700)."""
    sibling = path.with_name(f".{path.name}.{tag}-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    sibling.mkdir()
    return sibling


@contextlib.contextmanager
def _atomic_directory(out_dir: Path) -> Iterator[Path]:
    """Yield a temp directory next to `out_dir`; on success it replaces `out_dir`, on failure it is removed."""
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp = _unique_sibling(out_dir, "partial")
    try:
        yield tmp
        if out_dir.exists():  # overwrite: move the old one aside first (a rename cannot replace a non-empty dir)
            old = _unique_sibling(out_dir, "old")
            out_dir.rename(old / "old")
            tmp.rename(out_dir)
            shutil.rmtree(old, ignore_errors=True)
        else:
            try:
                tmp.rename(out_dir)
            except OSError as e:  # another process finished first (ENOTEMPTY / EEXIST): never merge the two
                raise FileExistsError(f"{out_dir} appeared while converting") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
