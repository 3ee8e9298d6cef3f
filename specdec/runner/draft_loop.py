"""The pure draft steps of a chain round as one static program: one CUDA graph per bucket on a GPU.

A draft model's chain round is a catch-up forward (step 0: ragged - whatever the draft's cache lacks, ending with the
last token) and then ``k - 1`` pure steps, each one token per request: forward, sample, feed the sample back. Run
one by one, each pure step costs the host a metadata build, a staging copy, a graph replay, the sampler's launches
and Python glue - per-forward fixed costs that make a small draft cost more than its bytes (c = 0.48-0.51 for the
Llama-3.2 1B/3B shapes against a byte share of 0.39 on an H100). Here the pure steps are one program over
persistent buffers, whose per-step updates happen on the device:

    for j in 1 .. steps:                        # position p = the input token's; seq_len = p + 1
        slot   = block_tables[b, p // bs] * bs + p % bs
        logits = lm_head(forward(ids, p, slot))                  # [n, W]
        cols, q = sample(logits, settings, philox position p + 1)
        tokens[:, j] = column_ids[cols]; q_out[:, j] = q; ids = tokens[:, j]; p += 1

captured once per bucket ``(batch, steps, block-table width, sampling kind)`` as a CUDA graph (mode
``"cuda_graph"``) or run as is (mode ``"eager"``: the same program, the CPU's check of the arithmetic). The sampler
is the engine's own (``sampling.sampler.sample_with_metadata``: greedy argmax, or temperature / top-k / top-p /
min-p and the Philox draw keyed by (seed, position, stream)), so a replay draws what the step-by-step loop draws -
up to the LM head's rounding: the program runs it on the bucket's rows, padding included, and a GPU's GEMM
may round a row differently at another row count (on the CPU, at equal counts, the tests see identical tokens and
q). Padding rows (a batch of n in a bucket of more) repeat row 0's settings - so the bucket's greedy / sampled
kind is the batch's - and feed token 0 at positions 0.. of the scratch block: they write and read only it.

Not served here (the caller's step-by-step loop runs instead): penalties (their context needs each step's drafts on
the host), per-round noise keys (block verification), a tree, more rows or steps than the buckets hold.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, fields

import torch

from specdec.model.llama import AttentionMetadata, LlamaForCausalLM
from specdec.sampling.metadata import SamplingMetadata
from specdec.sampling.probs import SamplingTensors
from specdec.sampling.sampler import sample_with_metadata

MODES = ("cuda_graph", "eager")
logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoopKey:
    batch: int  # rows (real + padding)
    steps: int  # pure draft steps in the program
    blocks: int  # block-table width
    kind: str  # the sampler's branches the rows take (sampling_kind)


def sampling_kind(st: SamplingTensors) -> str:
    """The branches of the sampler a batch takes - every row greedy, none or some; and whether a row filters (top-k
    / top-p / min-p) - as one key: a captured program holds one set of branches."""
    kind = "greedy" if st.all_greedy else ("mixed" if st.any_greedy else "sampled")
    return kind + ("+filter" if st.any_filter and not st.all_greedy else "")


@dataclass
class LoopOutput:
    """What a program run leaves on the device (views of the bucket's buffers: copy before the next run)."""

    tokens: torch.Tensor  # int64 [n, steps]: drafted target ids
    probs: torch.Tensor | None  # fp32 [n, steps, W]: q of each draw (None: every row greedy)
    bad_rows: torch.Tensor  # bool [n, steps]: the draw's logits held NaN / inf


class _LoopBuffers:
    """The persistent inputs and outputs of one bucket (``n = key.batch`` rows)."""

    def __init__(self, key: LoopKey, scratch_block: int, device: torch.device):
        n = key.batch
        self.key = key
        self.scratch_block = scratch_block
        self.ids = torch.zeros(n, dtype=torch.int64, device=device)  # [n] the step's input token
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)  # [n] its position
        self.block_tables = torch.full((n, key.blocks), scratch_block, dtype=torch.int32, device=device)
        self.cu_q_lens = torch.arange(n + 1, dtype=torch.int32, device=device)  # [n+1], constant
        self.tokens = torch.zeros(n, key.steps, dtype=torch.int64, device=device)
        self.bad = torch.zeros(n, key.steps, dtype=torch.bool, device=device)
        self.probs: torch.Tensor | None = None  # fp32 [n, steps, W], shared by the kinds of (batch, steps)
        self.st: SamplingTensors | None = None  # static settings [n], made at the first fill
        self.seeds = torch.zeros(n, dtype=torch.int64, device=device)
        self.sample_positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.graph: torch.cuda.CUDAGraph | None = None

    def fill(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor,
             meta: SamplingMetadata) -> None:
        """Copy the real rows in; padding rows get token 0 at position 0 of the scratch block and row 0's settings."""
        n, w = block_tables.shape
        self.ids[:n].copy_(ids, non_blocking=True)
        self.ids[n:].zero_()
        self.positions[:n].copy_(positions, non_blocking=True)
        self.positions[n:].zero_()
        self.block_tables[:n, :w].copy_(block_tables, non_blocking=True)
        self.block_tables[:n, w:].fill_(self.scratch_block)
        self.block_tables[n:].fill_(self.scratch_block)
        st = meta.st
        if self.st is None:  # static copies of the settings; the flags are the bucket's kind (LoopKey.kind)
            self.st = SamplingTensors(**{f.name: (getattr(st, f.name).new_zeros(self.key.batch)
                                                  if isinstance(getattr(st, f.name), torch.Tensor)
                                                  else getattr(st, f.name)) for f in fields(st)})
        for f in fields(st):
            value = getattr(st, f.name)
            if isinstance(value, torch.Tensor):
                _fill_rows(getattr(self.st, f.name), value)
        if meta.seeds is not None:
            _fill_rows(self.seeds, meta.seeds)

    def metadata(self) -> SamplingMetadata:
        greedy = self.key.kind.startswith("greedy")
        seeds = None if greedy else self.seeds
        positions = None if greedy else self.sample_positions
        return SamplingMetadata(self.st, seeds, positions, None)


def _fill_rows(dest: torch.Tensor, src: torch.Tensor) -> None:
    """``dest[:n] = src``, and every padding row a copy of row 0."""
    n = src.shape[0]
    dest[:n].copy_(src, non_blocking=True)
    dest[n:].copy_(src[:1].expand(dest.shape[0] - n))


class DraftLoopRunner:
    """Runs the pure draft steps of chain rounds as one static program per bucket; see the module docstring.

    Args:
        model: the draft model; ``kv_cache`` its pool tensors ``(k, v)``, each ``[L, num_blocks, block_size, Hkv,
            D]``; ``block_size``, ``max_blocks`` (the widest block table served), ``scratch_block`` (a block no
            sequence owns) as for ``StaticForwardRunner``.
        stream: the Philox stream of the draws (``STREAM_DRAFT``).
        column_ids: int64 ``[W]``, the target id of each logits column (a reduced draft vocabulary); None: column c
            is id c.
        batch_sizes, max_steps: the buckets (a batch of n runs in the smallest batch >= n; up to ``max_steps``).
        mode: "cuda_graph" (CUDA only) or "eager".
    """

    def __init__(self, model: LlamaForCausalLM, kv_cache: tuple[torch.Tensor, torch.Tensor], *, block_size: int,
                 max_blocks: int, scratch_block: int, stream: int, column_ids: torch.Tensor | None = None,
                 batch_sizes: Sequence[int] = (1, 2, 4, 8, 16, 32), max_steps: int = 16, mode: str = "cuda_graph"):
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        device = kv_cache[0].device
        if mode == "cuda_graph" and device.type != "cuda":
            raise ValueError(f"mode 'cuda_graph' needs the model on CUDA, it is on {device}; use 'eager'")
        self.model = model
        self.kv_cache = kv_cache
        self.block_size = block_size
        self.max_blocks = max_blocks
        self.scratch_block = scratch_block
        self.stream = stream
        self.column_ids = column_ids
        self.batch_sizes = tuple(sorted(set(batch_sizes)))
        self.max_steps = max_steps
        self.mode = mode
        self.device = device
        # NOTE: out_features, not weight.shape: a quantised head (QuantizedLinear) has no plain weight
        self.width = column_ids.shape[0] if column_ids is not None else model.lm_head.out_features
        self._buffers: dict[LoopKey, _LoopBuffers] = {}
        # q of every draw, [batch, steps, W] fp32 (64 x 7 x 128256 x 4 B = 230 MB at k = 8): one per (batch, steps),
        # shared by its sampling kinds - one round runs at a time, and its q is copied out before the next
        self._probs: dict[tuple[int, int], torch.Tensor] = {}
        self._graph_pool = None
        self.num_runs = 0  # rounds served
        self.num_steps = 0  # draft forwards served (steps of those rounds)
        self.num_fallbacks = 0  # run() calls answered None

    def bucket(self, num_rows: int, steps: int, width: int, kind: str) -> LoopKey | None:
        """The bucket of a round, or None when the caller's step-by-step loop must run it."""
        batch = next((b for b in self.batch_sizes if b >= num_rows), None)
        if batch is None or not 1 <= steps <= self.max_steps or width > self.max_blocks or num_rows < 1:
            return None
        return LoopKey(batch, steps, self.max_blocks, kind)

    def run(self, ids: torch.Tensor, positions: torch.Tensor, block_tables: torch.Tensor, meta: SamplingMetadata,
            steps: int) -> LoopOutput | None:
        """``steps`` pure draft steps for ``n`` rows, or None when no bucket serves them.

        Args:
            ids: int64 ``[n]`` the first step's input token (the catch-up step's draft), on the device.
            positions: int64 ``[n]`` its position (the request's token count); the draw at step j is keyed by
                position ``positions + j``, as ``draft_chains`` keys it.
            block_tables: int32 ``[n, w]``, covering every position written (``positions + steps - 1``).
            meta: the rows' sampling settings (``SamplingMetadata``; no penalties).
        Returns:
            ``LoopOutput`` views of the bucket's buffers (valid until the next run), or None.
        """
        n, width = block_tables.shape
        if meta.penalties is not None:
            raise ValueError("DraftLoopRunner does not serve penalties (their context is on the host each step)")
        key = self.bucket(n, steps, width, sampling_kind(meta.st))
        if key is None:
            self.num_fallbacks += 1
            return None
        buffers = self._buffers.get(key)
        if buffers is None:
            buffers = _LoopBuffers(key, self.scratch_block, self.device)
            if not key.kind.startswith("greedy"):
                shape = (key.batch, key.steps)
                if shape not in self._probs:
                    self._probs[shape] = torch.zeros(*shape, self.width, dtype=torch.float32, device=self.device)
                buffers.probs = self._probs[shape]
            if self.mode == "cuda_graph":
                buffers.fill(ids, positions, block_tables, meta)  # the static settings exist before the capture
                # NOTE: the warm-up and the capture run the program on this round's rows: they write the K/V the
                # replay writes again (same tokens, same slots), so a capture that fails leaves nothing wrong
                self._capture(buffers)
            self._buffers[key] = buffers
        buffers.fill(ids, positions, block_tables, meta)
        if buffers.graph is not None:
            buffers.graph.replay()
        else:
            self._program(buffers)
        self.num_runs += 1
        self.num_steps += steps
        return LoopOutput(buffers.tokens[:n, :steps], None if buffers.probs is None else buffers.probs[:n, :steps],
                          buffers.bad[:n, :steps])

    # ------------------------------------------------------------------------------------------ internals

    def _program(self, b: _LoopBuffers) -> None:
        """The pure steps over the bucket's buffers, every update on the device (what a graph captures)."""
        bs = self.block_size
        meta = b.metadata()
        with torch.inference_mode():
            for j in range(b.key.steps):
                pos = b.positions  # [n] int64
                block = b.block_tables.gather(1, (pos // bs).unsqueeze(1)).squeeze(1).long()  # [n]
                slots = block * bs + pos % bs  # [n]
                seq_lens = (pos + 1).to(torch.int32)  # [n]
                attn = AttentionMetadata(slots, b.block_tables, seq_lens, b.cu_q_lens, uniform_q_len=1)
                hidden = self.model.final_hidden_states(b.ids, pos, self.kv_cache, attn)  # [n, hidden]
                logits = self.model.logits(hidden)  # fp32 [n, W]
                b.sample_positions.copy_(pos + 1)
                bad: list[torch.Tensor] = []
                cols, probs = sample_with_metadata(logits, meta, self.stream, bad_rows=bad)  # [n], [n, W] | None
                tokens = cols if self.column_ids is None else self.column_ids[cols]
                b.tokens[:, j].copy_(tokens)
                b.bad[:, j].copy_(bad[0])
                if b.probs is not None:
                    b.probs[:, j].copy_(probs)
                b.ids.copy_(tokens)
                b.positions.add_(1)

    def _capture(self, b: _LoopBuffers) -> None:
        """Warm up on a side stream, then capture the program once (its positions advance: put them back)."""
        start_ids, start_pos = b.ids.clone(), b.positions.clone()
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                b.ids.copy_(start_ids)
                b.positions.copy_(start_pos)
                self._program(b)
        torch.cuda.current_stream(self.device).wait_stream(side)
        b.ids.copy_(start_ids)
        b.positions.copy_(start_pos)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            self._program(b)
        self._graph_pool = graph.pool()
        b.graph = graph
