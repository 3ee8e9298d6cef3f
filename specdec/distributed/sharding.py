"""Megatron-style sharding of the Llama forward: what each rank owns, and the slice of each checkpoint tensor it
reads.

- q heads: rank r owns heads ``[r * Hq/N, (r+1) * Hq/N)`` (``Hq % N == 0``);
- kv heads: split the same way when ``Hkv % N == 0``; when there are fewer kv heads than ranks (``N % Hkv ==
  0``) each rank keeps the one kv head its q heads read, replicated on ``N / Hkv`` ranks;
- qkv (fused) and gate/up (fused): column-parallel (each rank's output rows), biases likewise;
- o_proj and down_proj: row-parallel (each rank's input columns), one all-reduce each; o_proj's bias is added on
  rank 0 only (zeros elsewhere), so the sum counts it once;
- embedding and LM head: vocabulary-parallel, ``ceil(V / N)`` rows per rank, the last shard zero-padded; the
  embedding all-reduces its masked lookups, the LM head's logits are gathered on rank 0 once per forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from specdec.model.config import ModelConfig

_COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output rows split
_ROW_PARALLEL = ("o_proj", "down_proj")  # input columns split


def check_tensor_parallel(config: ModelConfig, size: int, what: str = "model") -> None:
    """``ValueError`` naming what is allowed unless ``config`` can be sharded over ``size`` ranks."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    hq, hkv, inter = config.num_attention_heads, config.num_key_value_heads, config.intermediate_size
    if hq % size:
        raise ValueError(f"the {what} has {hq} attention heads, which {size} ranks cannot share: tensor_parallel_size "
                         f"must divide num_attention_heads ({_divisors(hq)})")
    if hkv % size and size % hkv:
        raise ValueError(f"the {what} has {hkv} key/value heads: tensor_parallel_size must divide them or be a "
                         f"multiple of them (then they are replicated), got {size}")
    if inter % size:
        raise ValueError(f"the {what}'s intermediate_size {inter} is not divisible by tensor_parallel_size {size} "
                         f"(allowed: {[d for d in _divisors(hq) if inter % d == 0]})")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def check_quantized_tensor_parallel(config: ModelConfig, size: int, quantization: str | None,
                                    group_size: int | None, what: str = "model",
                                    option: str = "quantization_group_size") -> None:
    """``ValueError`` naming the allowed group sizes unless ``quantization``'s groups (``group_size``; None: the
    scheme's default - int8 per channel, int4 32) tile every rank's input widths under ``size`` ranks: the hidden
    size (q/k/v, gate/up, LM head: whole input rows on every rank) and each rank's share of the row-parallel
    inputs (o_proj ``Hq * D / size``, down_proj ``intermediate_size / size``). A group may not straddle a shard
    boundary: each rank quantises its own columns. Per-channel int8 (no group) shards anywhere."""
    if size == 1 or quantization is None:
        return
    if quantization == "gguf":
        raise ValueError(f"quantization='gguf' (the {what}'s GGUF blocks as stored) runs on one process; with "
                         f"tensor_parallel_size={size} use 'int8' or 'int4'")
    group = group_size if group_size is not None else {"int8": None, "int4": 32}[quantization]
    if group is None:
        return
    widths = {"hidden_size": config.hidden_size,
              "o_proj's input per rank": config.num_attention_heads * config.head_dim // size,
              "down_proj's input per rank": config.intermediate_size // size}
    bad = {name: w for name, w in widths.items() if w % group}
    if not bad:
        return
    common = math.gcd(*widths.values())
    allowed = [d for d in _divisors(common) if d >= 2 and (quantization != "int4" or d % 2 == 0)]
    shown = ", ".join(map(str, allowed[-12:])) or "none"
    per_channel = "; or None (per channel)" if quantization == "int8" else ""
    raise ValueError(f"{option}={group} does not divide the {what}'s "
                     f"{', '.join(f'{n} ({w})' for n, w in bad.items())} under tensor_parallel_size={size}: an "
                     f"{quantization} group must not straddle a shard boundary; allowed: a divisor of {common} "
                     f"({shown}){per_channel}")


@dataclass(frozen=True)
class ShardLayout:
    """The part of a model that rank ``rank`` of ``size`` holds (``size == 1``: the whole model)."""

    rank: int
    size: int
    num_heads: int  # q heads of this rank
    num_kv_heads: int  # kv heads of this rank (its own, or a replicated one)
    head_dim: int
    kv_head_start: int  # the first of this rank's kv heads in the checkpoint
    intermediate_size: int  # this rank's share of the MLP
    vocab_size: int  # the full vocabulary
    vocab_per_rank: int  # rows of this rank's embedding / LM head shard (ceil(V / size); the last one padded)

    @classmethod
    def of(cls, config: ModelConfig, rank: int = 0, size: int = 1) -> ShardLayout:
        check_tensor_parallel(config, size)
        assert 0 <= rank < size, f"rank {rank} outside a group of {size}"
        hkv = config.num_key_value_heads
        if hkv >= size:
            kv_heads, kv_start = hkv // size, rank * (hkv // size)
        else:  # fewer kv heads than ranks: one each, the one this rank's q heads read
            kv_heads, kv_start = 1, rank // (size // hkv)
        return cls(rank, size, config.num_attention_heads // size, kv_heads, config.head_dim, kv_start,
                   config.intermediate_size // size, config.vocab_size, -(-config.vocab_size // size))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @property
    def vocab_start(self) -> int:
        return self.rank * self.vocab_per_rank

    @property
    def vocab_rows(self) -> int:
        """Rows of the vocabulary this rank reads from the checkpoint (its shard without the padding)."""
        return max(0, min(self.vocab_size, self.vocab_start + self.vocab_per_rank) - self.vocab_start)

    def slice_of(self, hf_name: str, source):
        """The part of the checkpoint tensor ``hf_name`` (a ``TensorEntry`` or an in-memory tensor) this rank
        loads: a ``TensorSlice`` / narrowed tensor, read on demand; ``source`` itself when it is replicated (norms)
        or ``size == 1``; a zero tensor for o_proj's bias on ranks > 0."""
        if self.size == 1:
            return source
        name = hf_name.removeprefix("model.")
        part = name.split(".")[-2] if "." in name else name
        kind = name.split(".")[-1]  # weight | bias
        if part in ("embed_tokens", "lm_head"):
            return source.narrow(0, self.vocab_start, self.vocab_rows)
        if part == "q_proj":
            return source.narrow(0, self.rank * self.q_size, self.q_size)
        if part in ("k_proj", "v_proj"):
            return source.narrow(0, self.kv_head_start * self.head_dim, self.kv_size)
        if part in ("gate_proj", "up_proj"):
            return source.narrow(0, self.rank * self.intermediate_size, self.intermediate_size)
        if part in _ROW_PARALLEL:
            if kind == "bias":  # added once, after the all-reduce's sum: rank 0 holds it
                return source if self.rank == 0 else torch.zeros(tuple(source.shape))
            width = self.q_size if part == "o_proj" else self.intermediate_size
            return source.narrow(1, self.rank * width, width)
        return source  # replicated: norms
