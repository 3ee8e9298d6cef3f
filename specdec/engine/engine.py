"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out (streaming is built on step()).

The engine owns the requests and the loop; each other job has its file: request validation
(``request_validation.py``), one step's computation (``step.py``), output processing and stop checks
(``output_processor.py``), n > 1 fan-out and merging (``parallel_sampling.py``), scheduling (``scheduler.py``).
What stays here: failure isolation (a step that raises is split and retried until the failure is pinned on the
requests it belongs to) and the commit of each request's update. Over 300 lines because a request's whole lifetime
(add, abort, step, commit, fail, finish) mutates the engine's one table of requests; the jobs that do not are in
the files above.
"""

from __future__ import annotations

import functools
import itertools
import logging
import random
import time

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.checkpoint.loader import load_model
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.detokenizer import finalize_text
from specdec.engine.output_processor import append_tokens, request_output
from specdec.engine.parallel_sampling import SampleGroups, sample_ids, sample_params, sample_seed
from specdec.engine.request_validation import validate_request
from specdec.engine.scheduler import ScheduledBatch, Scheduler
from specdec.engine.sequence import Sequence, Status
from specdec.engine.step import RequestUpdate, compute_step, undo_step
from specdec.engine.tensor_parallel import start_workers
from specdec.model.config import ModelConfig
from specdec.outputs import RequestOutput
from specdec.runner.cuda_graphs import static_forward_mode
from specdec.runner.model_runner import ModelRunner
from specdec.sampling.params import SamplingParams
from specdec.spec_decode.speculator import Speculator
from specdec.structured.grammar import GrammarCompiler
from specdec.tokenizer.tokenizer import Tokenizer

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None):
        self.config = config
        self.model_config: ModelConfig = config.model_config
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(config.model_path)
        self._grammar_compiler: GrammarCompiler | None = None  # structured outputs (grammar_compiler())
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.device = config.device
        # tensor parallelism: rank 0's shards, the other ranks' worker processes (None: one process)
        self.workers = start_workers(config, speculative)
        try:
            self._build(config, speculative)
        except BaseException:
            self.shutdown()
            raise

    def _build(self, config: EngineConfig, speculative: SpeculativeConfig | None) -> None:
        if self.workers is not None:
            self.model, self.pool = self.workers.shards[0]
        else:
            self.model = load_model(config.model_path, config.dtype, config.device, config.max_model_len + 1,
                                    self.model_config, config.prepack_weights, config.quantization,
                                    config.quantization_group_size, config.gguf_source,
                                    quantize_lm_head=config.quantize_lm_head,
                                    batch_invariant=config.batch_invariant)
            self.pool = KVPool(self.model_config, config.num_kv_blocks, config.block_size, config.dtype,
                               config.device)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size,
                                          _prefix_caching(config, speculative))
        self.runner = ModelRunner(self.model, self.pool, self.block_manager, self.device)
        draft_shard = self.workers.shards[1] if self.workers is not None and len(self.workers.shards) > 1 else None
        self.speculative = (Speculator(config, speculative, self.tokenizer, target=self.model,
                                       draft_shard=draft_shard) if speculative else None)
        # the target's pool first (its prefix cache decides where a request starts), then the proposer's, allocated
        # in lockstep; a decoding request reserves its lookahead (speculation budget) beyond its last token
        self.block_managers = [self.block_manager,
                               *(self.speculative.proposer.block_managers if self.speculative else [])]
        lookahead = self.speculative.policy.lookahead if self.speculative is not None else (lambda seq: 0)
        self.scheduler = Scheduler(self.block_managers, config.max_num_seqs, config.max_num_batched_tokens,
                                   lookahead=lookahead)
        if self.speculative is not None:  # (no closure over the engine: a reference cycle would keep its pools alive)
            self.scheduler.on_free.append(functools.partial(_free_proposer_state, self.speculative))
        mode = static_forward_mode(config.device, config.enforce_eager)
        if mode is not None and self.workers is None:  # NOTE: no static forwards under tensor parallelism yet
            self.enable_static_forward(mode)
        if self.speculative is not None:  # adaptive k's costs, measured before the first request
            draft_model = self.speculative.proposer.draft_model
            self.speculative.policy.calibrate(self.runner, draft_model.runner if draft_model is not None else None)
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._requests: dict[str, Sequence] = {}  # unfinished sequences by their own (internal) id
        self._samples = SampleGroups()  # requests with n > 1
        self._pending: list[RequestOutput] = []  # outputs of aborted requests, reported by the next step()
        self._num_failed = 0

    def enable_static_forward(self, mode: str, block_buckets: tuple[int, ...] | None = None) -> None:
        """Uniform batches through static forwards (specdec/runner/cuda_graphs.py): the target's decodes and chain
        windows of every length up to k + 1, the draft model's one-token steps - and in modes "cuda_graph" and
        "eager" the pure steps of a draft model's chain round as one program (``DraftModelProposer.enable_draft_loop``,
        specdec/runner/draft_loop.py). Called at start-up with ``"cuda_graph"`` on CUDA unless ``enforce_eager``;
        ``"eager"`` / ``"compile"`` exercise the same path on CPU (tests, ``bench.costs.host_overhead --static``).
        Takes one
        block of each pool for padding rows (``EngineConfig.create`` sizes the pools with one to spare when graphs are
        on). ``block_buckets``: the block-table widths served (None: one, the widest; the CPU attention gathers the
        whole width, so on CPU several widths keep short sequences cheap). Not under tensor parallelism
        (``ValueError``)."""
        if self.workers is not None:
            raise ValueError("static forwards (CUDA graphs, torch.compile) are not supported with "
                             "tensor_parallel_size > 1 yet")
        policy = self.speculative.policy if self.speculative is not None else None
        k = policy.k_max if policy is not None else 0
        max_seq_len = self.config.max_model_len + (policy.max_tree_nodes if policy is not None else 0) + 1
        max_batch = self.config.max_num_seqs
        self.runner.enable_static_forward(mode, tuple(range(1, k + 2)), max_seq_len, max_batch, block_buckets)
        draft_model = self.speculative.proposer.draft_model if self.speculative is not None else None
        if draft_model is not None:
            draft_model.runner.enable_static_forward(mode, (1,), max_seq_len, max_batch, block_buckets)
            draft_model.loop = None  # a second call in another mode drops the earlier loop
            if mode in ("cuda_graph", "eager"):  # a chain round's pure draft steps as one program (CUDA graph)
                try:
                    draft_model.enable_draft_loop(mode, max_seq_len, max_batch, max(k - 1, 1))
                except Exception as exc:  # noqa: BLE001 - the optional fast path: draft step by step instead
                    logger.warning("draft loop (%s) not enabled, drafting step by step: %r", mode, exc)

    # --- lifetime ------------------------------------------------------------------------------------------
    @property
    def health_error(self) -> str | None:
        """Why the engine cannot run another step (a tensor-parallel worker died or hung), or None."""
        return self.workers.error if self.workers is not None else None

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (a no-op for a one-process engine); never hangs, idempotent. The
        engine cannot step afterwards. Also done when the engine is collected and at interpreter exit."""
        if self.workers is not None:
            self.workers.shutdown()

    # --- requests ------------------------------------------------------------------------------------------
    def validate_request(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> list[int]:
        """Token ids of a request, or ``ValueError`` saying what is wrong (a structured output's constraint is
        compiled here: a bad schema is refused before anything is queued). Changes no request state."""
        ids = validate_request(prompt, prompt_token_ids, params, self.tokenizer, self.model_config.vocab_size,
                               self.config.max_model_len)
        if params.structured_outputs is not None:
            self.grammar_compiler().compile(params.structured_outputs)
        return ids

    def grammar_compiler(self) -> GrammarCompiler:
        """The engine's structured-output compiler (built on first use; ``ValueError`` without a tokenizer)."""
        if self._grammar_compiler is None:
            if self.tokenizer is None:
                raise ValueError("structured outputs need the model's tokenizer.json, and this model folder has none")
            tok = self.tokenizer
            eos = set(self.eos_token_ids)
            if tok.eos_token is not None and tok.token_to_id(tok.eos_token) is not None:
                eos.add(tok.token_to_id(tok.eos_token))
            self._grammar_compiler = GrammarCompiler(tok.to_json(), self.model_config.vocab_size, sorted(eos),
                                                     tok.vocab_size)
        return self._grammar_compiler

    def add_request(
        self,
        prompt: str | None = None,
        params: SamplingParams | None = None,
        prompt_token_ids: list[int] | None = None,
        request_id: str | None = None,
        tenant: str | None = None,
    ) -> str:
        """Validate and queue a request; returns its id. ``tenant``: who sent it (None: the anonymous tenant);
        state shared across requests - the suffix drafter's index - is shared only within a tenant.

        ``params.n > 1`` queues n samples (sequences) of the prompt (engine/parallel_sampling.py); ``step()`` and
        ``abort()`` report them as one ``RequestOutput`` under the returned id, ``outputs[i]`` for sample i."""
        params = params if params is not None else SamplingParams()
        if tenant is not None and (not isinstance(tenant, str) or not tenant):
            raise ValueError(f"tenant must be None or a non-empty string, got {tenant!r}")
        ids = self.validate_request(prompt, prompt_token_ids, params)
        seq_ids = [next(self._seq_ids) for _ in range(params.n)]
        request_id = request_id if request_id is not None else str(seq_ids[0])
        own_ids = sample_ids(request_id, params.n)
        if (request_id in self._requests or request_id in self._samples or any(i in self._requests for i in own_ids)
                or any(out.request_id == request_id for out in self._pending)):
            raise ValueError(f"request id {request_id!r} is already in use (or its abort is not yet reported by "
                             "step())")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seqs = []
        for i, (seq_id, own_id) in enumerate(zip(seq_ids, own_ids)):
            seed = sample_seed(params, i, self._seed_rng.getrandbits(63) if params.seed is None else 0)
            seq = Sequence(seq_id, own_id, prompt, ids, sample_params(params, i, seed), seed, eos)
            seq.metrics.num_prompt_tokens = len(ids)
            seq.logprobs = [] if params.logprobs is not None else None
            seq.tenant = tenant
            if params.structured_outputs is not None:  # each sample its own matcher
                seq.grammar = self.grammar_compiler().state(params.structured_outputs)
            seqs.append(seq)
        if params.n > 1:
            self._samples.add(request_id, seqs)
        for seq in seqs:
            self._requests[seq.request_id] = seq
            self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """Drop a request and free its blocks in every pool. Returns its final output (``finish_reason ==
        "abort"``), which the next ``step()`` also reports; None for unknown or finished ids. A request with
        n > 1 aborts all its samples that are still running (so does the internal id of one of its samples)."""
        request_id = self._samples.request_of(request_id)
        group = self._samples.samples(request_id)
        if group is not None:
            for seq in group:
                if not seq.is_finished:
                    self._finish(seq, "abort")
            out = self._samples.output(request_id)
            self._samples.forget(request_id)
            self._pending.append(out)
            return out
        seq = self._requests.get(request_id)
        if seq is None or seq.is_finished:
            return None
        self._finish(seq, "abort")
        out = request_output(seq)
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
            return self._samples.merge(outputs + self._fail_unschedulable())
        if self.speculative is not None:
            self.speculative.policy.batch_size = len(batch.seqs)  # what adaptive k plans the next step for
        try:
            updates, failures = self._compute_isolated(batch)
        except BaseException:  # KeyboardInterrupt and the like: the step is undone; keep the queued outputs
            undo_step(batch.seqs, self.speculative)  # a half that succeeded before a retry was interrupted too
            self._pending = outputs + self._pending
            raise
        for seq in batch.seqs:
            if seq.seq_id in failures:
                outputs.append(self._fail(seq, failures[seq.seq_id]))
            elif seq.seq_id in updates:
                out = self._commit(updates[seq.seq_id])
                if out is not None:
                    outputs.append(out)
        return self._samples.merge(outputs)

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
        """Apply one request's update: after a verified round its KV edit (``Speculator.finish_round``: the accepted
        path moved, both caches cut to the kept KV), its KV length, its tokens through the output processor, its
        metrics. A failure here ends that request only. None if the step emitted nothing for it (a mid-prompt
        chunk)."""
        seq = update.seq
        try:
            if update.verified:  # before num_computed advances: the round's root is still at num_computed
                self.speculative.finish_round(seq, update.num_computed, update.drafted, update.accepted,
                                              update.accepted_nodes, self.pool, self.block_manager)
            seq.num_computed = update.num_computed
            m = seq.metrics
            m.target_forwards += 1
            m.draft_forwards += update.draft_forwards
            if update.lookahead_granted is not None:
                m.k_per_step.append(update.lookahead_granted)
            if not update.new_tokens:
                return None
            before = len(seq.output_token_ids)
            reason, stopped_by_string = append_tokens(seq, update.new_tokens, update.logprobs, self.tokenizer)
            if update.verified:  # tau counts what a round emitted after stop truncation
                m.record_round(update.drafted, update.accepted, len(seq.output_token_ids) - before)
            if reason is not None:
                self._finish(seq, reason, stopped_by_string)
            return request_output(seq)
        except Exception as e:  # noqa: BLE001
            return self._fail(seq, f"{type(e).__name__}: {e}")

    def _fail(self, seq: Sequence, message: str) -> RequestOutput:
        """End ``seq`` with ``finish_reason == "error"``, freeing its blocks in every pool."""
        seq.error = message
        self._num_failed += 1
        self._finish(seq, "error")
        return request_output(seq)

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


def _prefix_caching(config: EngineConfig, speculative: SpeculativeConfig | None) -> bool:
    """Whether the target's pool caches prefixes: as configured, except under a proposer fed the target's hidden
    states (EAGLE-3), which has none for a cached prefix: the whole prompt is computed instead."""
    if config.enable_prefix_caching and speculative is not None and speculative.reads_target_hidden_states:
        logger.info("prefix caching is off with method %r: the head needs the target's hidden states of every "
                    "prompt token", speculative.method)
        return False
    return config.enable_prefix_caching


def _free_proposer_state(speculator: Speculator, seq: Sequence) -> None:
    """The scheduler freed ``seq``'s blocks: finished (for good) or preempted (it comes back)."""
    speculator.free(seq.seq_id, seq.is_finished)
