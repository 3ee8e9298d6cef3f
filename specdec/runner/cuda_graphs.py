"""Static-shape forwards of uniform batches: CUDA graphs per batch-size bucket, ``torch.compile`` or eager on CPU.

A *uniform* batch is one where every sequence has the same number ``q_len`` of new tokens and is causal: a decode
(``q_len = 1``), a draft step (1), a chain verification window (``k + 1``). Its forward has shapes fixed by
``(batch, q_len, block-table width)`` and, with ``AttentionMetadata.uniform_q_len`` set, reads no device value
on the host (``ops.paged_attention``'s uniform path). So it can be

- captured once per bucket as a CUDA graph and replayed with new inputs copied into static buffers (mode
  ``"cuda_graph"``, the vLLM / gpt-fast recipe: warm up on a side stream, capture, replay), or
- compiled by ``torch.compile(fullgraph=True)`` once per bucket (mode ``"compile"``, CPU or CUDA), or
- run as is on the padded static buffers (mode ``"eager"``: the same bucketing and padding, no capture).

Over 300 lines because the three modes share one set of buckets, buffers and padding rules: split, they would
have to agree on them across files.

A batch of ``n`` sequences runs in the smallest batch bucket ``>= n``; rows ``n..bucket-1`` are *padding rows*:
token 0 at positions ``0..q_len-1``, ``seq_len = q_len``, every block-table entry the reserved ``scratch_block``
and K/V slots inside it (``scratch_block * block_size + i % block_size``). A padding row therefore writes K/V
only into the scratch block, reads only the scratch block (always finite: it holds K/V some padding row wrote,
or the pool's initial zeros) and its logits are dropped. The scratch block must belong to no sequence: reserve
it from the block manager once (see :func:`reserve_scratch_block`). Anything the buckets do not cover (more
sequences than the largest bucket, a ``q_len`` not captured, a wider block table, ragged or tree batches) is
the caller's eager path: :meth:`StaticForwardRunner.run` returns None for it.
"""

from __future__ import annotations

import types
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from specdec.model.llama import AttentionMetadata, LlamaForCausalLM

DEFAULT_BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64)
MODES = ("cuda_graph", "compile", "eager")
SCRATCH_SEQ_ID = -1  # the block manager sequence that owns the scratch block (reserve_scratch_block)


def reserve_scratch_block(block_manager, seq_id: int = SCRATCH_SEQ_ID) -> int:
    """Take one block from ``block_manager`` for padding rows (a pseudo-sequence ``seq_id`` that is never freed,
    never cached and never scheduled) and return its id. The pool must have been sized with one block to spare."""
    block_manager.allocate(seq_id, block_manager.block_size)
    return block_manager.block_table(seq_id)[0]


def static_forward_mode(device: torch.device, enforce_eager: bool) -> str | None:
    """The runner mode an engine uses (``EngineConfig.device`` / ``enforce_eager``): ``"cuda_graph"`` on CUDA
    unless ``enforce_eager``; None (no runner: every forward eager) otherwise. On CPU that is measured, not
    assumed: the static forward under ``torch.compile`` ran SmolLM2-135M's decode 9% faster than eager at batch 1
    and 26% slower at batch 8, for a compile per bucket (docs/architecture.md, "CUDA graphs and the static
    forward"), so CPU stays eager (mode "compile" is there to opt into)."""
    return "cuda_graph" if device.type == "cuda" and not enforce_eager else None


def uniform_q_len(items: Sequence) -> int | None:
    """``q_len`` if the forward items (``ForwardItem``: ``token_ids``, ``positions``, ``mask``) form a uniform
    causal batch - every item has the same number of new tokens at consecutive positions, no tree mask - else
    None (ragged prefill, mixed decodes and windows, trees: the eager forward)."""
    if not items:
        return None
    q_len = len(items[0].token_ids)
    for item in items:
        if len(item.token_ids) != q_len or item.mask is not None or item.positions is not None:
            return None
    return q_len if q_len > 0 else None


@dataclass(frozen=True)
class BucketKey:
    batch: int  # sequences (real + padding rows)
    q_len: int  # new tokens per sequence
    blocks: int  # block-table width


class _StaticBatch:
    """The persistent inputs of one bucket (allocated once; ``run`` copies a step's values into them) and its
    output after capture. Every tensor is on the model's device."""

    def __init__(self, key: BucketKey, block_size: int, scratch_block: int, device: torch.device):
        n, q, nb = key.batch, key.q_len, key.blocks
        self.key = key
        pad_pos = torch.arange(q, device=device).repeat(n)  # int64 [n*q]: padding rows sit at 0..q-1
        self.pad_positions = pad_pos
        self.pad_slots = scratch_block * block_size + pad_pos % block_size  # int64 [n*q] inside the scratch block
        self.scratch_block = scratch_block
        self.ids = torch.zeros(n * q, dtype=torch.int64, device=device)  # [n*q]
        self.positions = pad_pos.clone()  # int64 [n*q]
        self.slot_mapping = self.pad_slots.clone()  # int64 [n*q]
        self.block_tables = torch.full((n, nb), scratch_block, dtype=torch.int32, device=device)  # [n, nb]
        self.seq_lens = torch.full((n,), q, dtype=torch.int32, device=device)  # [n]
        self.cu_q_lens = torch.arange(0, (n + 1) * q, q, dtype=torch.int32, device=device)  # [n+1], constant
        # once captured (cuda_graph mode): the final-norm hidden states [n*q, hidden] in the model's dtype. The
        # LM head runs outside the graph on the rows a step wants: no [n*q, V] buffer per bucket (~1 GB over the
        # default buckets at V = 128256, k = 4), and no head for padding rows.
        self.output: torch.Tensor | None = None
        self.graph: torch.cuda.CUDAGraph | None = None
        self.compiled = None  # the compiled static forward (compile mode)

    def fill(self, ids, positions, slot_mapping, block_tables, seq_lens) -> None:
        """Copy a step's real rows in (``n <= batch`` sequences, table width ``w <= blocks``) and reset the rest
        to padding rows (a previous, larger batch's rows must not write into its sequences' slots again)."""
        n, w = block_tables.shape
        t = ids.shape[0]
        self.ids[:t].copy_(ids, non_blocking=True)
        self.ids[t:].zero_()
        self.positions[:t].copy_(positions, non_blocking=True)
        self.positions[t:].copy_(self.pad_positions[t:])
        self.slot_mapping[:t].copy_(slot_mapping, non_blocking=True)
        self.slot_mapping[t:].copy_(self.pad_slots[t:])
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, w:].fill_(self.scratch_block)
        self.block_tables[n:].fill_(self.scratch_block)
        self.seq_lens[:n].copy_(seq_lens, non_blocking=True)
        self.seq_lens[n:].fill_(self.key.q_len)


class StaticForwardRunner:
    """Run uniform batches through per-bucket static forwards (CUDA graphs, compiled, or eager); see the module
    docstring for buckets and padding rows.

    Args:
        model: the model; ``kv_cache`` its pool tensors ``(k, v)``, each ``[L, num_blocks, block_size, Hkv, D]``.
        block_size: the pool's block size. ``max_blocks``: the widest block table served (usually
            ``ceil((max_model_len + lookahead) / block_size)``); wider ones fall back.
        scratch_block: a block no sequence owns, written and read by padding rows (:func:`reserve_scratch_block`).
        q_lens: the new-token counts served (e.g. ``(1, k + 1)``); others fall back.
        batch_sizes: the batch buckets; a batch of n runs in the smallest one >= n, more than the largest falls back.
        block_buckets: the block-table widths served, each <= ``max_blocks``; a table of width w runs in the
            smallest one >= w. Default ``(max_blocks,)``: one width (the CUDA kernel's cost follows the real
            ``seq_lens``, not the width). The CPU attention gathers the whole width, so on CPU several widths
            (e.g. powers of two) keep short sequences cheap.
        mode: "cuda_graph" (CUDA only), "compile" (``torch.compile(fullgraph=True)``; ``compile_options`` go to
            it) or "eager".
    """

    def __init__(
        self,
        model: LlamaForCausalLM,
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        *,
        block_size: int,
        max_blocks: int,
        scratch_block: int,
        q_lens: Sequence[int] = (1,),
        batch_sizes: Sequence[int] = DEFAULT_BATCH_BUCKETS,
        block_buckets: Sequence[int] | None = None,
        mode: str = "cuda_graph",
        compile_options: dict | None = None,
    ):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = kv_cache[0].device
        if mode == "cuda_graph" and device.type != "cuda":
            raise ValueError(f"mode 'cuda_graph' needs the model on CUDA, it is on {device}; use 'compile' or 'eager'")
        for name, values in (("q_lens", q_lens), ("batch_sizes", batch_sizes)):
            if not values or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in values):
                raise ValueError(f"{name} must be a non-empty sequence of integers >= 1, got {values!r}")
        block_buckets = tuple(block_buckets) if block_buckets is not None else (max_blocks,)
        if not block_buckets or any(not isinstance(b, int) or not 1 <= b <= max_blocks for b in block_buckets):
            raise ValueError(f"block_buckets must be integers in [1, max_blocks={max_blocks}], got {block_buckets!r}")
        num_blocks = kv_cache[0].shape[1]
        if not 0 <= scratch_block < num_blocks:
            raise ValueError(f"scratch_block {scratch_block} is not a block of the pool [0, {num_blocks})")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.q_lens = tuple(sorted(set(q_lens)))
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.block_buckets = tuple(sorted(set(block_buckets)))
        self.mode = mode
        self.device = device
        self.compile_options = dict(compile_options or {})
        self._batches: dict[BucketKey, _StaticBatch] = {}
        self._graph_pool = None  # one memory pool shared by every captured graph (captured largest first)
        self.num_replays = 0  # forwards served by a static bucket
        self.num_fallbacks = 0  # run() calls answered None

    # ------------------------------------------------------------------------------------------ buckets

    def bucket(self, num_seqs: int, q_len: int, num_blocks: int) -> BucketKey | None:
        """The bucket a uniform batch of ``num_seqs`` sequences x ``q_len`` tokens with a block table of
        ``num_blocks`` columns runs in, or None when it must fall back to the eager forward."""
        if q_len not in self.q_lens or num_seqs < 1:
            return None
        batch = next((b for b in self.batch_sizes if b >= num_seqs), None)
        blocks = next((b for b in self.block_buckets if b >= num_blocks), None)
        if batch is None or blocks is None:
            return None
        return BucketKey(batch, q_len, blocks)

    def keys(self) -> list[BucketKey]:
        """Every bucket, largest first (the capture order: later graphs reuse the first one's memory pool)."""
        return [BucketKey(b, q, nb) for b in reversed(self.batch_sizes) for q in reversed(self.q_lens)
                for nb in reversed(self.block_buckets)]  # fmt: skip

    def prepare(self, keys: Sequence[BucketKey] | None = None) -> None:
        """Capture (cuda_graph) or compile (compile) the given buckets now, default all; ``run`` does it lazily
        for a bucket it has not seen."""
        for key in keys if keys is not None else self.keys():
            self._static_batch(key)

    # ------------------------------------------------------------------------------------------ run

    def run(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        slot_mapping: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        q_len: int,
        logits_indices: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """One uniform forward through its bucket, or None if no bucket serves it (run the eager forward then).

        Args (the real rows only; any device, copied into the bucket's buffers):
            input_ids, positions, slot_mapping: int64 ``[n * q_len]``, sequence b's tokens at rows
                ``b * q_len : (b + 1) * q_len``.
            block_tables: int32 ``[n, w]``; seq_lens: int32 ``[n]`` (new tokens included, ``>= q_len``).
            q_len: new tokens per sequence (Python int).
            logits_indices: int64 ``[N]`` rows of ``0 .. n*q_len-1`` whose logits are wanted; None = all rows.
        Returns:
            fp32 logits ``[N, V]`` (or ``[n*q_len, V]``), a tensor of its own (not the graph's output buffer): the
            static forward gives the final-norm hidden states, and the LM head runs eagerly on the wanted rows.
        """
        num_seqs, width = block_tables.shape
        if input_ids.shape[0] != num_seqs * q_len or seq_lens.shape[0] != num_seqs:
            raise ValueError(f"a uniform batch of {num_seqs} sequences x q_len {q_len} needs {num_seqs * q_len} "
                             f"input ids and {num_seqs} seq_lens, got {input_ids.shape[0]} and {seq_lens.shape[0]}")
        key = self.bucket(num_seqs, q_len, width)
        if key is None:
            self.num_fallbacks += 1
            return None
        static = self._static_batch(key)
        static.fill(input_ids, positions, slot_mapping, block_tables, seq_lens)
        if static.graph is not None:
            static.graph.replay()
            out = static.output
        elif static.compiled is not None:
            with torch.no_grad():
                out = static.compiled(static.ids, static.positions, static.slot_mapping, static.block_tables,
                                      static.seq_lens, static.cu_q_lens)  # fmt: skip
        else:
            out = self._forward(static)
        self.num_replays += 1
        rows = num_seqs * q_len
        hidden = out[:rows] if logits_indices is None else out[:rows][logits_indices]  # [N, hidden]
        with torch.inference_mode():
            return self.model.logits(hidden)

    # ------------------------------------------------------------------------------------------ internals

    def _forward(self, static: _StaticBatch) -> torch.Tensor:
        meta = AttentionMetadata(static.slot_mapping, static.block_tables, static.seq_lens, static.cu_q_lens,
                                 uniform_q_len=static.key.q_len)  # fmt: skip
        with torch.inference_mode():
            return self.model.final_hidden_states(static.ids, static.positions, self.kv_cache, meta)

    def _static_batch(self, key: BucketKey) -> _StaticBatch:
        static = self._batches.get(key)
        if static is None:
            static = _StaticBatch(key, self.block_size, self.scratch_block, self.device)
            if self.mode == "cuda_graph":
                self._capture(static)
            elif self.mode == "compile":
                static.compiled = torch.compile(_static_forward(self.model, self.kv_cache, key), fullgraph=True,
                                                **self.compile_options)  # fmt: skip
            self._batches[key] = static
        return static

    def _capture(self, static: _StaticBatch) -> None:
        """Warm up on a side stream (Triton compiles, cuBLAS picks its kernels, the allocator settles), then
        capture one forward of the padding-only buffers: it writes K/V into the scratch block only."""
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                self._forward(static)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            static.output = self._forward(static)  # [batch*q_len, hidden], lives in the graph's pool
        self._graph_pool = graph.pool()
        static.graph = graph


def _static_forward(model: LlamaForCausalLM, kv_cache: tuple[torch.Tensor, torch.Tensor], key: BucketKey):
    """The forward of one bucket as a function of its buffers, for ``torch.compile``.

    Each bucket gets a function with its own code object: Dynamo keeps its compiled graphs per code object, so one
    shared function would count every bucket as a recompile of the others and hit the recompile limit (8)."""
    q_len = key.q_len

    def forward(ids, positions, slot_mapping, block_tables, seq_lens, cu_q_lens):
        meta = AttentionMetadata(slot_mapping, block_tables, seq_lens, cu_q_lens, uniform_q_len=q_len)
        return model.final_hidden_states(ids, positions, kv_cache, meta)

    name = f"static_forward_b{key.batch}_q{key.q_len}_nb{key.blocks}"
    code = forward.__code__.replace(co_name=name)  # a new code object (co_qualname is Python >= 3.11 only)
    return types.FunctionType(code, forward.__globals__, name, forward.__defaults__, forward.__closure__)
