"""Start-up calibration of adaptive k's cost model: time the forwards it prices before the first request.

Adaptive k values a chain of k drafts by ``E(k) / (k c + v(k))``; a cold cost model knows neither c nor v(k) and
stands in priors until the engine's own forwards have been timed. Online, a cost key is measured only when its arm
is chosen, and a target decode of one token (the denominator of every v(k) and of c) only on plain steps - which a
request that drafts never takes. So a cold engine could sit at a short k for many steps on a guess (measured on the
Qwen pair in float32 on CPU: k = 1 for 14 of the first 16 steps of a code prompt whose best fixed k is 4).

``calibrate`` does what vLLM's start-up profiling run does for memory, for time: with the engine idle it runs the
target forward of 1..k_max+1 tokens per request and (with a draft model) the draft's one-token step, on scratch
sequences in the runners' own pools, through the runners' own path (the static forward / CUDA graph where the
engine would take it), and hands the timings to the cost model exactly as the engine's rounds do - the first of
each key is the cost model's warm-up sample (discarded), then ``reps`` samples, enough for each key to answer for
itself (``MeasuredCostModel.min_samples``). Online samples then refine the same keys (a median window of the most
recent ones), so a machine whose speed changes later is followed as before.

Only batch size 1 is calibrated (the serving case speculation is for; other batch sizes are learned online), at a
``context`` of 128 cached tokens. The clock is the engine's own (``ForwardTimer``: the thread's CPU time with one
intra-op thread on CPU, CUDA events on a GPU - synchronised here, at start-up, where a sync costs nothing).
"""

from __future__ import annotations

import torch

from specdec.runner.model_runner import ForwardItem, ModelRunner
from specdec.spec_decode.forward_timer import ForwardTimer

SCRATCH_SEQ_ID = -2  # the runners' scratch block is -1; calibration's pseudo-sequence
CONTEXT = 128  # cached tokens behind the timed forwards


def time_forward(runner: ModelRunner, q_len: int, samples: int, context: int = CONTEXT) -> list[float]:
    """Seconds of ``samples`` forwards of ``q_len`` new tokens (logits for all) over ``context`` cached ones, one
    scratch sequence, through ``runner.forward``. The sequence's blocks are freed afterwards; nothing else in the
    pool is touched (the K/V written lands in the scratch sequence's own blocks). ``[]`` when the pool has no room."""
    bm = runner.block_manager
    need = context + q_len
    if not bm.can_allocate(need + bm.block_size):  # room to spare: never the last blocks of the pool
        return []
    vocab = runner.model.config.vocab_size
    ids = torch.randint(0, vocab, (q_len,), generator=torch.Generator().manual_seed(q_len)).tolist()
    timer = ForwardTimer()
    seconds: list[float] = []
    bm.allocate(SCRATCH_SEQ_ID, need)
    try:
        for _ in range(samples):
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
            start = timer.start(runner.device)
            runner.forward([ForwardItem(SCRATCH_SEQ_ID, ids, context, q_len)])
            timer.stop(start, seconds.append)
            if runner.device.type == "cuda":
                torch.cuda.synchronize(runner.device)
                timer.flush()
    finally:
        bm.free(SCRATCH_SEQ_ID)
    return seconds


def calibrate(cost_model, target: ModelRunner, draft: ModelRunner | None, k_max: int, max_len: int,
              reps: int = 3) -> None:
    """Feed ``cost_model`` (``observe_target`` / ``observe_draft``) batch-1 timings of the target forward of 1..k_max+1
    tokens and, with ``draft``, of one draft step: ``reps + 1`` forwards each (the first is the warm-up sample).
    ``max_len``: the most positions a sequence may hold (the context is shortened to fit)."""
    context = max(0, min(CONTEXT, max_len - (k_max + 1)))
    for q_len in range(1, k_max + 2):
        for seconds in time_forward(target, q_len, reps + 1, context):
            cost_model.observe_target(1, q_len, seconds)
    if draft is not None:
        for seconds in time_forward(draft, 1, reps + 1, context):
            cost_model.observe_draft(1, seconds)
