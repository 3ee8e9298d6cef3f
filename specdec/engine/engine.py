"""LLMEngine: requests in, one scheduled step at a time, RequestOutputs out (streaming is built on step())."""

from __future__ import annotations

import itertools
import random
import time

from specdec.cache.block_manager import BlockManager
from specdec.cache.kv_pool import KVPool
from specdec.config import EngineConfig, SpeculativeConfig
from specdec.engine.detokenizer import append_text, finalize_text
from specdec.engine.model_runner import ModelRunner
from specdec.engine.plain_step import plain_item, sample_plain
from specdec.engine.scheduler import ScheduledBatch, Scheduler
from specdec.engine.sequence import Sequence, Status
from specdec.engine.speculative import SpeculativeDecoder
from specdec.model.config import ModelConfig
from specdec.model.loader import load_model
from specdec.model.tokenizer import Tokenizer
from specdec.outputs import CompletionOutput, RequestOutput
from specdec.sampling.params import SamplingParams


class LLMEngine:
    def __init__(self, config: EngineConfig, speculative: SpeculativeConfig | None = None):
        self.config = config
        self.model_config: ModelConfig = config.model_config
        self.tokenizer: Tokenizer | None = Tokenizer.from_dir(config.model_path)
        self.eos_token_ids = frozenset(config.eos_token_ids)
        self.device = config.device
        self.model = load_model(config.model_path, config.dtype, config.device, config.max_model_len + 1,
                                self.model_config, config.prepack_weights)
        self.block_manager = BlockManager(config.num_kv_blocks, config.block_size)
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
        self._seq_ids = itertools.count()
        self._seed_rng = random.Random(config.seed)
        self._requests: dict[str, Sequence] = {}

    # --- requests ------------------------------------------------------------------------------------------
    def validate_request(
        self, prompt: str | None, prompt_token_ids: list[int] | None, params: SamplingParams
    ) -> list[int]:
        """Token ids of a request, or ``ValueError`` saying what is wrong. Changes no state."""
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
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
        """Validate and queue a request; returns its id."""
        params = params if params is not None else SamplingParams()
        ids = self.validate_request(prompt, prompt_token_ids, params)
        seq_id = next(self._seq_ids)
        request_id = request_id if request_id is not None else str(seq_id)
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        seed = params.seed if params.seed is not None else self._seed_rng.getrandbits(63)
        eos = frozenset() if params.ignore_eos else self.eos_token_ids
        seq = Sequence(seq_id, request_id, prompt, ids, params, seed, eos)
        seq.metrics.num_prompt_tokens = len(ids)
        self._requests[request_id] = seq
        self.scheduler.add(seq)
        return request_id

    def abort(self, request_id: str) -> None:
        """Drop a request and free its blocks (unknown or finished ids are ignored)."""
        seq = self._requests.pop(request_id, None)
        if seq is not None and not seq.is_finished:
            seq.status = Status.FINISHED
            seq.finish_reason = "abort"
            self.scheduler.finish(seq)

    @property
    def stats(self) -> dict:
        """Engine-wide counters (speculative rollbacks)."""
        return dict(self.speculative.stats) if self.speculative else {}

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished()

    # --- the step ------------------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one scheduled forward; outputs for every request that advanced (cumulative, vLLM-style)."""
        batch = self.scheduler.schedule()
        if not batch.seqs:
            return []
        if self.speculative is None:
            return self._process(batch.seqs, self._plain_step(batch), verified=set())
        new_tokens = self.speculative.step(batch, self.runner, self.block_manager)
        return self._process(batch.seqs, new_tokens, verified=self.speculative.last_verified)

    def _plain_step(self, batch: ScheduledBatch) -> dict[int, list[int]]:
        items = [plain_item(seq, n) for seq, n in zip(batch.seqs, batch.num_new_tokens)]
        logits = self.runner.forward(items)  # (sequences that complete, V)
        sampling = [seq for seq, item in zip(batch.seqs, items) if item.num_logits]
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed += n
            seq.metrics.target_forwards += 1
        return sample_plain(logits, sampling)

    def _process(
        self, seqs: list[Sequence], new_tokens: dict[int, list[int]], verified: set[int]
    ) -> list[RequestOutput]:
        """Append accepted tokens, check stop conditions token by token, free finished requests.

        ``verified``: ids of the sequences whose tokens came from a verification round (for tau)."""
        outputs = []
        now = time.perf_counter()
        for seq in seqs:
            tokens = new_tokens.get(seq.seq_id)
            if not tokens:
                continue
            if seq.metrics.first_token_time is None:
                seq.metrics.first_token_time = now
            before = len(seq.output_token_ids)
            for token in tokens:
                seq.output_token_ids.append(token)
                stopped_by_string = self.tokenizer is not None and append_text(seq, self.tokenizer)
                reason = self._finish_reason(seq, token, stopped_by_string)
                if reason is not None:
                    self._finish(seq, reason, stopped_by_string)
                    break
            if seq.seq_id in verified:  # tau counts what a round emitted after stop truncation
                seq.metrics.num_round_tokens += len(seq.output_token_ids) - before
            seq.metrics.num_generated_tokens = len(seq.output_token_ids)
            outputs.append(self._output(seq))
        return outputs

    def _finish_reason(self, seq: Sequence, token: int, stopped_by_string: bool) -> str | None:
        if stopped_by_string or token in seq.eos_token_ids or token in seq.params.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= seq.params.max_tokens:
            return "length"
        return None

    def _finish(self, seq: Sequence, reason: str, stopped_by_string: bool) -> None:
        seq.status = Status.FINISHED
        seq.finish_reason = reason
        seq.metrics.finished_time = time.perf_counter()
        if self.tokenizer is not None:
            finalize_text(seq, self.tokenizer, stopped_by_string)
        self.scheduler.finish(seq)
        self._requests.pop(seq.request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = seq.output_text[: seq.stable_text_len]
        return RequestOutput(
            request_id=seq.request_id,
            prompt=seq.prompt,
            prompt_token_ids=seq.prompt_token_ids,
            outputs=[CompletionOutput(0, text, list(seq.output_token_ids), seq.finish_reason)],
            finished=seq.is_finished,
            metrics=seq.metrics.as_dict(),
        )
