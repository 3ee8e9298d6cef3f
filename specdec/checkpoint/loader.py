"""Find a model (local folder, hub repo id, or .gguf file) and load its weights into our forward."""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Iterator

import torch
from tqdm.auto import tqdm

from specdec.checkpoint.safetensors_reader import TensorEntry, read_header
from specdec.distributed.comm import TPGroup
from specdec.distributed.sharding import check_quantized_tensor_parallel
from specdec.model import batch_invariant as batch_invariant_kernels
from specdec.model.config import ModelConfig
from specdec.model.linear import check_prepack_option, prepack_linears, prepack_supported
from specdec.model.llama import LlamaForCausalLM
from specdec.paths import cache_root

HUB_FILES = [
    "config.json",
    "generation_config.json",
    "*.safetensors",
    "model.safetensors.index.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "chat_template.jinja",  # recent checkpoints ship their chat template in its own file
]

logger = logging.getLogger(__name__)


def resolve_model_path(model: str, revision: str | None = None) -> str:
    """A local HF-style directory for ``model``: a folder as is, a .gguf converted once, a hub id downloaded (at
    ``revision``: a branch, tag or commit; None: the default branch). ``revision`` with a local path is refused."""
    if not isinstance(model, str) or not model:
        raise ValueError(f"model must be a non-empty path or hub repo id, got {model!r}")
    if revision is not None:
        if not isinstance(revision, str) or not revision:
            raise ValueError(f"revision must be a branch, tag or commit of a hub repo (a non-empty string), got "
                             f"{revision!r}")
        if model.endswith(".gguf") or os.path.exists(model) or model.count("/") != 1 or model.startswith((".", "/")):
            raise ValueError(f"revision={revision!r} is for a hub repo id (org/name); {model!r} is a local path: "
                             "drop revision, or check out that revision into the folder")
    if model.endswith(".gguf"):
        if not os.path.isfile(model):
            raise ValueError(f"GGUF file not found: {model}")
        return _converted_gguf_dir(model)
    if os.path.isdir(model):
        return model
    if os.path.exists(model):
        raise ValueError(f"{model} is a file, but not a .gguf; pass a model directory, a .gguf or a hub repo id")
    if model.count("/") == 1 and not model.startswith((".", "/")):
        return _download_from_hub(model, revision)
    raise ValueError(f"model {model!r} is neither an existing directory, a .gguf file nor a hub repo id (org/name)")


def _converted_gguf_dir(path: str) -> str:
    from specdec.checkpoint.gguf import convert_gguf

    st = os.stat(path)
    key = hashlib.sha256(f"{os.path.abspath(path)}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:16]
    name = os.path.basename(path).removesuffix(".gguf")
    out_dir = str(cache_root() / "converted" / f"{name}-{key}")
    if not os.path.isfile(os.path.join(out_dir, "config.json")):
        convert_gguf(path, out_dir)
    return out_dir


def _download_from_hub(repo_id: str, revision: str | None = None) -> str:
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import GatedRepoError, LocalEntryNotFoundError, RepositoryNotFoundError

    offline = os.environ.get("HF_HUB_OFFLINE", "0").lower() in ("1", "true", "yes")
    at = f" at revision {revision!r}" if revision is not None else ""
    try:
        return snapshot_download(repo_id, revision=revision, allow_patterns=HUB_FILES, local_files_only=offline)
    except GatedRepoError as e:  # before RepositoryNotFoundError: it is one
        raise ValueError(f"{repo_id!r} is a gated repository: accept its license on the hub, then set HF_TOKEN (or "
                         f"run `huggingface-cli login`) with an account that has access ({e})") from e
    except RepositoryNotFoundError as e:
        raise ValueError(f"{repo_id!r}{at} was not found on the hub; a private repository needs HF_TOKEN set "
                         f"({e})") from e
    except LocalEntryNotFoundError as e:
        raise ValueError(
            f"model {repo_id!r}{at} is not in the local Hugging Face cache and the hub cannot be reached"
            f"{' (HF_HUB_OFFLINE is set)' if offline else ''}; download it with network access first, "
            f"or pass a local directory or .gguf file"
        ) from e
    except Exception as e:  # network / auth / not-found errors from the hub client
        raise ValueError(f"could not fetch {repo_id!r}{at} from the Hugging Face hub: {e}") from e


def safetensors_files(path: str) -> list[str]:
    """The weight files of a model folder (sharded through an index, or every ``*.safetensors``)."""
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {path}")
    full = [os.path.join(path, f) for f in files]
    missing = [f for f in full if not os.path.isfile(f)]
    if missing:
        raise ValueError(f"weight files listed in the index are missing: {missing}")
    return full


def iter_weight_entries(path: str) -> Iterator[tuple[str, TensorEntry]]:
    """Every tensor of the model folder ``path``, as a ``TensorEntry`` (read on demand, straight into place)."""
    files = safetensors_files(path)
    for file in tqdm(files, desc="loading weights", disable=len(files) < 2):
        for entry in read_header(file):
            yield entry.name, entry


def read_checkpoint_tensor(path: str, name: str) -> torch.Tensor:
    """One tensor of the model folder ``path`` by its HF name (with or without the ``model.`` prefix), read into
    memory in its stored dtype; ``ValueError`` if the folder has none."""
    for entry_name, entry in iter_weight_entries(path):
        if entry_name.removeprefix("model.") == name.removeprefix("model."):
            return entry.read()
    raise ValueError(f"{path} has no tensor {name!r}")


def iter_weights(path: str) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor of the model folder ``path``, read into memory one at a time (stored dtype, CPU)."""
    for name, entry in iter_weight_entries(path):
        yield name, entry.read()


def load_model(
    path: str, dtype: torch.dtype, device: torch.device, max_positions: int, config: ModelConfig | None = None,
    prepack_weights: bool | None = None, quantization: str | None = None, quantization_group_size: int | None = None,
    gguf_path: str | None = None, shared_embedding: torch.nn.Parameter | None = None, group: TPGroup | None = None,
    quantize_lm_head: bool | None = None, batch_invariant: bool | None = None,
) -> LlamaForCausalLM:
    """Build our forward for the HF folder ``path`` and load its weights (no random init is ever computed).

    The parameters are allocated once, in ``dtype`` on ``device``, and every tensor is read from its file
    straight into them (``specdec/checkpoint/safetensors_reader.py``): no full-precision copy of the model and no
    mapped file is ever held, so loading peaks at the model's running size plus one read chunk.
    ``prepack_weights``: replace every linear weight by its oneDNN-prepacked copy (``specdec/model/linear.py``).
    None = where supported (CPU, float32, or bfloat16 with native bf16); True = always (``ValueError`` where
    unsupported); False = never (plain weights and ``F.linear``).
    ``quantization``: None, "int8", "int4" or "gguf" (``gguf_path``'s blocks as stored) - every linear but a tied
    LM head quantised while loading
    (specdec/checkpoint/quant_load.py), group ``quantization_group_size``; ``quantize_lm_head``: None as just said,
    True also a tied head (its own quantised copy), False never the head; ``gguf_path``: the GGUF the folder was
    converted from, whose Q4_0 / Q4_1 / Q8_0 blocks are kept where they map exactly. ``shared_embedding``: use
    this embedding tensor (a self draft shares the target's) instead of reading one. ``group``: load rank
    ``group.rank``'s tensor-parallel shard only - every tensor's slice read straight from its file
    (``ShardLayout.slice_of``, ``TensorSlice``), so a rank never holds more than its share plus the replicated
    norms (specdec/distributed/sharding.py); with ``quantization`` each rank quantises its own slices while
    loading (``ValueError`` where a group would straddle a shard boundary), and ``shared_embedding`` is then this
    rank's shard of the target's embedding ``[ceil(V / N), hidden]``. ``group`` need not be connected: loading
    makes no collective. ``batch_invariant``: run the row-invariant CPU kernels (specdec/model/batch_invariant.py;
    None: where they are not slower, unless ``prepack_weights`` is False) - they take the place of the oneDNN
    packed copies; with ``prepack_weights=False`` and True the plain weights stay beside their packed copies.
    """
    check_prepack_option(prepack_weights, dtype, torch.device(device))
    batch_invariant_kernels.check_option(batch_invariant, dtype, torch.device(device))
    config = config or ModelConfig.from_json(path)
    if group is not None:
        check_quantized_tensor_parallel(config, group.size, quantization, quantization_group_size)
    with torch.device("meta"):
        model = LlamaForCausalLM(config, max_positions=max_positions, group=group)
    model = model.to(dtype)  # meta -> meta in dtype (free)
    if quantization is not None or shared_embedding is not None:
        from specdec.checkpoint.quant_load import load_quantized

        load_quantized(model, iter_weight_entries(path), quantization, quantization_group_size, torch.device(device),
                       dtype, gguf_path=gguf_path, shared_embedding=shared_embedding,
                       quantize_lm_head=quantize_lm_head)
    else:
        model = model.to_empty(device=device)  # one allocation
        model.rope.reset(device)  # cos/sin tables are computed, not loaded; keep them fp32
        if config.tie_word_embeddings:
            model.lm_head.weight = model.embed_tokens.weight
        model.load_weights(iter_weight_entries(path))
    if prepack_weights is False and batch_invariant is None:
        batch_invariant = False  # plain weights asked for (torch.compile, quantize_linears): no packed copy either
    invariant = batch_invariant_kernels.resolve(batch_invariant, dtype, torch.device(device))
    if invariant and (why := batch_invariant_kernels.unsupported_attention(model)) is not None:
        if batch_invariant is True:
            raise ValueError(f"batch_invariant=True: {why}")
        logger.info("batch-invariant kernels off for this model: %s", why)
        invariant = False
    if invariant:
        batch_invariant_kernels.enable(model, release_weights=prepack_weights is not False)
    elif prepack_weights is not False and prepack_supported(dtype, torch.device(device)):
        prepack_linears(model, required=prepack_weights is True)
    return model.eval()
