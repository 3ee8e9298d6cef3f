"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out (streaming is built on step())."""

from __future__ import annotations

import dataclasses
import itertools
import random
import time

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.cuda_graphs import static_forward_mode
from specdec.engine.detokenizer import append_text, finalize_text
from specdec.engine.model_runner import ModelRunner
from specdec.engine.scheduler import ScheduledBatch, Scheduler
from specdec.engine.sequence import RequestMetrics, Sequence, Status
from specdec.engine.speculative import SpeculativeDecoder
from specdec.engine.step import RequestUpdate, compute_step, undo_step
from specdec.model.config import ModelConfig
from specdec.model.loader import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.params import SamplingParams, child_seed


class LLMEngine:
    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None):
        self.config = config
        self.model_config: ModelConfig = config.model_config
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(config.model_path)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.device = config.device
        self.model = load_model(config.model_path, config.dtype, config.device, config.max_model_len + 1,
                                self.model_config, config.prepack_weights)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size, config.enable_prefix_caching)
        self.pool = KVPool(self.model_config, config.num_kv_blocks, config.block_size, config.dtype, config.device)
        self.runner = ModelRunner(self.model, self.pool, self.block_manager, self.device)
        self.speculative = SpeculativeDecoder(config, speculative, self.tokenizer) if speculative else None
        if self.speculative is None:
            self.scheduler = Scheduler([self.block_manager], config.max_num_seqs, config.max_num_batched_tokens)
        else:
            # target and draft pools are allocated in lockstep; the lookahead is the request's k_eff
            pools = [self.block_manager] + ([self.speculative.block_manager] if self.speculative.block_manager else [])
            self.scheduler = Scheduler(pools, config.max_num_seqs, config.max_num_batched_tokens,
                                       lookahead=self.speculative.lookahead)
            self.scheduler.on_free.append(self.speculative.free)
            self.speculative.target_pool = self.pool  # tree rounds compact the accepted path's K/V in it
        mode = static_forward_mode(config.device, config.enforce_eager)
        if mode is not None:
            self.enable_static_forward(mode)
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._requests: dict[str, Sequence] = {}
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its samples, for requests with n > 1
        self._sample_of: dict[str, str] = {}  # a sample's internal id ("<request id>#<i>") -> its request id
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, reported by the next step()
        self._num_failed = 0

    def enable_static_forward(self, mode: str, block_buckets: tuple[int, ...] | None = None) -> None:
        """Uniform batches through static forwards (specdec/engine/cuda_graphs.py): the target's decodes and chain
        windows of every length up to k + 1, the draft model's one-token steps. Called at start-up with
        ``"cuda_graph"`` on CUDA unless ``enforce_eager``; ``"eager"`` / ``"compile"`` exercise the same path on
        CPU (tests, ``bench.host_overhead --static``). Takes one block of each pool for padding rows
        (``EngineConfig.create`` sizes the pools with one to spare when graphs are on). ``block_buckets``: the
        block-table widths served (None: one, the widest; the CPU attention gathers the whole width, so on CPU
        several widths keep short sequences cheap)."""
        spec = self.speculative
        k = spec.k if spec is not None else 0
        max_seq_len = self.config.max_model_len + (spec.spec.tree_nodes(k) if spec is not None else 0) + 1
        max_batch = self.config.max_num_seqs
        self.runner.enable_static_forward(mode, tuple(range(1, k + 2)), max_seq_len, max_batch, block_buckets)
        if spec is not None and spec._model_drafter is not None:
            spec._model_drafter.runner.enable_static_forward(mode, (1,), max_seq_len, max_batch, block_buckets)

    # --- requests ------------------------------------------------------------------------------------------
    def validate_request(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> list[int]:
        """Token ids of a request, or ``ValueError`` saying what is wrong. Changes no state."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        params.__post_init__()  # again: a field may have been changed since construction
        if prompt_token_ids is None:
            if not isinstance(prompt, str):
                raise ValueError(f"prompt must be a string, got {type(prompt).__name__}")
            if self.tokenizer is None:
                raise ValueError("this model folder has no tokenizer.json: pass prompt_token_ids instead of text")
            prompt_token_ids = self.tokenizer.encode(prompt)
        if not isinstance(prompt_token_ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in prompt_token_ids
        ):
            raise ValueError("prompt_token_ids must be a list of ints")
        if len(prompt_token_ids) == 0:
            raise ValueError("the prompt is empty; give at least one token")
        vocab = self.model_config.vocab_size
        bad = [t for t in prompt_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"prompt token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
        total = len(prompt_token_ids) + params.max_tokens
        if total > self.config.max_model_len:
            raise ValueError(
                f"prompt ({len(prompt_token_ids)} tokens) + max_tokens ({params.max_tokens}) = {total} exceeds "
                f"max_model_len={self.config.max_model_len}; shorten the prompt or lower max_tokens"
            )
        return list(prompt_token_ids)

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id.

        ``params.n > 1`` queues n samples (sequences) of the prompt, sample i seeded ``child_seed(seed, i)``
        (sample 0 = the n == 1 request; an unseeded request draws n seeds); ``step()`` and ``abort()`` report them
        as one ``RequestOutput`` under the returned id, ``outputs[i]`` for sample i."""
        params = params if params is not None else SamplingParams()
        ids = self.validate_request(prompt, prompt_token_ids, params)
        seq_ids = [next(self._seq_ids) for _ in range(params.n)]
        request_id = request_id if request_id is not None else str(seq_ids[0])
        own_ids = [request_id] if params.n == 1 else [f"{request_id}#{i}" for i in range(params.n)]
        if (request_id in self._requests or request_id in self._groups or any(i in self._requests for i in own_ids)
                or any(out.request_id == request_id for out in self._pending)):
            raise ValueError(f"request id {request_id!r} is already in use (or its abort is not yet reported by "
                             "step())")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seqs = []
        for i, (seq_id, own_id) in enumerate(zip(seq_ids, own_ids)):
            seed = child_seed(params.seed, i) if params.seed is not None else self._seed_rng.getrandbits(63)
            sample_params = params if params.n == 1 else dataclasses.replace(
                params, n=1, seed=None if params.seed is None else seed)
            seq = Sequence(seq_id, own_id, prompt, ids, sample_params, seed, eos)
            seq.metrics.num_prompt_tokens = len(ids)
            seq.logprobs = [] if params.logprobs is not None else None
            if params.n > 1:
                seq.parent_id, seq.index = request_id, i
                self._sample_of[own_id] = request_id
            seqs.append(seq)
        if params.n > 1:
            self._groups[request_id] = seqs
        for seq in seqs:
            self._requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks in every pool. Returns its final output (``finish_reason ==
        "abort"``), which the next ``step()`` also reports; None for unknown or finished ids. A request with
        n > 1 aborts all its samples that are still running (so does the internal id of one of its samples)."""
        request_id = self._sample_of.get(request_id, request_id)
        group = self._groups.get(request_id)
        if group is not None:
            for seq in group:
                if not seq.is_finished:
                    self._finish(seq, "abort")
            out = self._group_output(request_id)
            self._forget_group(request_id)
            self._pending.append(out)
            return out
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self._finish(seq, "abort")
        out = self._output(seq)
        self._pending.append(out)
        return out

    @property
    def stats(self) -> dict:
        """Engine-wide counters (speculative rollbacks, requests failed, prefix-cache queries and hits)."""
        return {**(self.speculative.stats if self.speculative else {}), "failed_requests": self._num_failed,
                **self.block_manager.stats}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; outputs for every request that advanced or ended (cumulative, vLLM-style).

        Never raises for a request's failure: a request whose part of the step fails ends with
        ``finish_reason == "error"`` (its message in ``RequestOutput.error``), its blocks freed in every pool,
        and the other requests go on as if it had never been there (docs/architecture.md, "Failure isolation").
        """
        batch = self.scheduler.schedule()
        outputs, self._pending = self._pending, []  # after schedule(): if that raises, nothing queued is lost
        if not batch.seqs:
            return self._merge_samples(outputs + self._fail_unschedulable())
        if self.speculative is not None:
            self.speculative.batch_size = len(batch.seqs)  # what adaptive k plans the next step for
        try:
            updates, failures = self._compute_isolated(batch)
        except BaseException:  # KeyboardInterrupt and the like: the step is undone; keep the queued outputs
            self._pending = outputs + self._pending
            raise
        for seq in batch.seqs:
            if seq.seq_id in failures:
                outputs.append(self._fail(seq, failures[seq.seq_id]))
            elif seq.seq_id in updates:
                out = self._commit(updates[seq.seq_id])
                if out is not None:
                    outputs.append(out)
        return self._merge_samples(outputs)

    def _compute_isolated(self, batch: ScheduledBatch, retry: bool = False
                          ) -> tuple[dict[int, RequestUpdate], dict[int, str]]:
        """(updates, failures) by seq id. A step that raises changed no request (engine/step.py); it is split in
        halves and retried until every failure is pinned on the single requests it belongs to, so the others
        get exactly the tokens an unfaulted step gives them (randomness depends on (seed, position) only).
        Retries time nothing for adaptive k (a sub-batch is not the batch size the costs are kept for). A
        ``BaseException`` that is not an ``Exception`` (Ctrl-C) is undone too, then re-raised."""
        try:
            updates = compute_step(batch, self.runner, self.speculative, observe_costs=not retry)
            return {u.seq.seq_id: u for u in updates}, {}
        except BaseException as e:
            undo_step(batch.seqs, self.speculative)
            if not isinstance(e, Exception):
                raise
            if len(batch) == 1:
                return {}, {batch.seqs[0].seq_id: f"{type(e).__name__}: {e}"}
            half = len(batch) // 2
            updates, failures = self._compute_isolated(
                ScheduledBatch(batch.seqs[:half], batch.num_new_tokens[:half]), retry=True)
            more_updates, more_failures = self._compute_isolated(
                ScheduledBatch(batch.seqs[half:], batch.num_new_tokens[half:]), retry=True)
            return {**updates, **more_updates}, {**failures, **more_failures}

    def _commit(self, update: RequestUpdate) -> RequestOutput | None:
        """Apply one request's update; a failure here ends that request only."""
        seq = update.seq
        try:
            seq.num_computed = update.num_computed
            m = seq.metrics
            m.target_forwards += 1
            m.draft_forwards += update.draft_forwards
            if update.k_granted is not None:
                m.k_per_step.append(update.k_granted)
            if update.verified:
                self.speculative.commit_round(seq, update.drafted, update.accepted, self.block_manager)
            return self._process(seq, update.new_tokens, update.verified, update.logprobs)
        except Exception as e:  # noqa: BLE001
            return self._fail(seq, f"{type(e).__name__}: {e}")

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End ``seq`` with ``finish_reason == "error"``, freeing its blocks in every pool."""
        seq.error = message
        self._num_failed += 1
        self._finish(seq, "error")
        return self._output(seq)

    def _fail_unschedulable(self) -> list[RequestOutput]:
        """Nothing could be scheduled although requests are unfinished: no later step would change that, so
        end them with an error that says why instead of returning nothing forever."""
        stuck = list(self.scheduler.running) + list(self.scheduler.waiting)
        free = self.block_manager.num_free_blocks
        return [
            self._fail(seq, f"the scheduler could not make progress on this request (status {seq.status.value}, "
                            f"{seq.num_computed}/{seq.num_tokens} tokens computed, {free} free KV blocks)")
            for seq in stuck
        ]

    def _process(self, seq: Sequence, tokens: list[int], verified: bool, logprobs: list[dict] | None = None
                 ) -> RequestOutput | None:
        """Append a step's tokens one by one (with their logprobs, when kept), check stop conditions after each
        (EOS, stop ids, stop strings, max_tokens), detokenise, and finish the request if one holds. None if the
        step emitted nothing."""
        if not tokens:
            return None
        if seq.logprobs is not None and (logprobs is None or len(logprobs) != len(tokens)):
            raise RuntimeError(f"the step computed {0 if logprobs is None else len(logprobs)} logprobs for "
                               f"{len(tokens)} tokens")
        m = seq.metrics
        if m.first_token_time is None:
            m.first_token_time = time.perf_counter()
        before = len(seq.output_token_ids)
        for i, token in enumerate(tokens):
            seq.output_token_ids.append(token)
            if seq.logprobs is not None:  # kept aligned with output_token_ids: tokens after a stop are dropped
                seq.logprobs.append(logprobs[i])
                seq.cumulative_logprob += logprobs[i][token]
            stopped_by_string = self.tokenizer is not None and append_text(seq, self.tokenizer)
            reason = self._finish_reason(seq, token, stopped_by_string)
            if reason is not None:
                self._finish(seq, reason, stopped_by_string)
                break
        if verified:  # tau counts what a round emitted after stop truncation
            m.num_round_tokens += len(seq.output_token_ids) - before
        m.num_generated_tokens = len(seq.output_token_ids)
        return self._output(seq)

    def _finish_reason(self, seq: Sequence, token: int, stopped_by_string: bool) -> str | None:
        if stopped_by_string or token in seq.eos_token_ids or token in seq.params.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, stopped_by_string: bool = False) -> None:
        """Retire ``seq``: free its blocks in every pool (always, even if finalising its text fails)."""
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()
        self._requests.pop(seq.request_id, None)
        try:
            self.scheduler.finish(seq)
        finally:
            if self.tokenizer is not None and reason != "error":
                finalize_text(seq, self.tokenizer, stopped_by_string)

    def _output(self, seq: Sequence) -> RequestOutput:
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[self._completion(seq)],
            finished=seq.is_finished,
            metrics=seq.metrics.as_dict(),
            error=seq.error,
        )

    @staticmethod
    def _completion(seq: Sequence) -> CompletionOutput:
        logprobs = None if seq.logprobs is None else list(seq.logprobs)
        return CompletionOutput(seq.index, seq.output_text[: seq.stable_text_len], list(seq.output_token_ids),
                                seq.finish_reason, logprobs, None if logprobs is None else seq.cumulative_logprob)

    # --- n > 1: samples reported as one request ------------------------------------------------------------
    def _group_output(self, request_id: str) -> RequestOutput:
        """One ``RequestOutput`` for all samples of ``request_id``: ``outputs[i]`` is sample i (cumulative, every
        sample every time); finished when all are; ``error`` lists the samples that failed."""
        seqs = self._groups[request_id]
        errors = [f"output {s.index}: {s.error}" for s in seqs if s.error is not None]
        return RequestOutput(
            request_id=request_id,
            prompt=seqs[0].prompt,
            prompt_token_ids=seqs[0].prompt_token_ids,
            outputs=[self._completion(s) for s in seqs],
            finished=all(s.is_finished for s in seqs),
            metrics=RequestMetrics.merged([s.metrics for s in seqs]).as_dict(),
            error="; ".join(errors) if errors else None,
        )

    def _merge_samples(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the outputs of samples (n > 1) by their request's output, once per request, at the place of its
        first sample; a request whose samples have all finished is forgotten after its final output."""
        merged: list[RequestOutput] = []
        groups: list[str] = []
        for out in outputs:
            parent = self._sample_of.get(out.request_id)
            if parent is None:
                merged.append(out)
            elif parent not in groups:
                groups.append(parent)
                merged.append(self._group_output(parent))
        for parent in groups:
            if all(s.is_finished for s in self._groups[parent]):
                self._forget_group(parent)
        return merged

    def _forget_group(self, request_id: str) -> None:
        for seq in self._groups.pop(request_id):
            self._sample_of.pop(seq.request_id, None)
