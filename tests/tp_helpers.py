"""Tiny checkpoints and forwards shared by the model-level tensor-parallel tests (tests/tp/test_tp_model.py,
tests/tp/test_tp_quant.py) and their NCCL twin (tests/gpu/test_tp_nccl.py)."""

from __future__ import annotations

import torch
from tiny_models import make_tiny_model

from specdec.cache.block_manager import BlockManager
from specdec.runner.model_runner import ForwardItem, ModelRunner

VOCAB = 301
VARIANTS = {  # name -> make_tiny_model options
    "llama-untied-kv2": {"model_type": "llama", "num_kv_heads": 2},
    "llama-tied-kv1": {"model_type": "llama", "num_kv_heads": 1, "tie_word_embeddings": True},
    "qwen2-untied-kv4": {"model_type": "qwen2", "num_kv_heads": 4},
    "qwen2-tied-kv2": {"model_type": "qwen2", "num_kv_heads": 2, "tie_word_embeddings": True},
}
BLOCKS, BLOCK_SIZE, MAX_POS = 16, 4, 128


def write_variants(root) -> dict[str, str]:
    """The ``VARIANTS`` as tiny checkpoints under ``root``: name -> folder."""
    out = {}
    for i, (name, opts) in enumerate(VARIANTS.items()):
        path = str(root / name)
        make_tiny_model(path, seed=10 + i, vocab_size=VOCAB, num_heads=4, with_tokenizer=False, **opts)
        out[name] = path
    return out


def run_forwards(model, pool, device: str = "cpu") -> torch.Tensor:
    """Prefill two sequences in chunks, decode, then a 3-token tree window: every logits row, stacked, as fp32 on
    the CPU (tests/gpu/test_tp_nccl.py runs the same forwards on cuda:0)."""
    bm = BlockManager(pool.num_blocks, pool.block_size)
    runner = ModelRunner(model, pool, bm, torch.device(device))
    bm.allocate(0, 6)
    bm.allocate(1, 9)
    rows = [runner.forward([ForwardItem(0, [3, 17, 256, 300, 5, 9], 0, 6), ForwardItem(1, [1, 2, 3, 4], 0, 1)])]
    rows.append(runner.forward([ForwardItem(1, [150, 151, 152, 299, 0], 4, 5)]))
    bm.append_slots(0, 7)
    bm.append_slots(1, 10)
    rows.append(runner.forward([ForwardItem(0, [42], 6, 1), ForwardItem(1, [7], 9, 1)]))
    bm.append_slots(0, 10)
    mask = torch.tensor([[1, 0, 0], [1, 1, 0], [1, 0, 1]], dtype=torch.bool)  # node 2 is a sibling of node 1
    rows.append(runner.forward([ForwardItem(0, [8, 77, 78], 7, 3, positions=[7, 8, 8], mask=mask)]))
    return torch.cat(rows).float().cpu()  # (17, V)
