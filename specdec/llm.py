"""The facade users import: ``LLM(model).generate(prompts, SamplingParams(...))`` (vLLM's shape)."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from specdec.checkpoint.default_model import default_model_path
from specdec.config import EngineConfig, SpeculativeConfig, speculative_config_from_dict
from specdec.engine.engine import LLMEngine
from specdec.outputs import RequestOutput
from specdec.sampling.params import SamplingParams


class LLM:
    """Load a model and generate.

    Args:
        model: a local Hugging Face-style folder, a ``.gguf`` file (converted once and cached), or a hub repo id;
            None = the embedded default model, SmolLM2-135M-Instruct (``specdec.default_model_path()``).
        dtype: "float32" | "bfloat16" | "float16" | "auto": the checkpoint's dtype on GPU; on CPU the faster one
            (bf16 checkpoints in bf16 on CPUs with native bf16, everything else in fp32; docs/benchmarks.md).
        device: "cpu" | "cuda" | "auto".
        max_model_len: longest prompt + output; default min(model limit, 8192).
        block_size: tokens per KV-cache block.
        max_num_seqs: most requests decoded together.
        num_kv_blocks / kv_cache_memory_gb: pool size in blocks, or in GiB when blocks are not given (per rank
            under tensor parallelism: the blocks of that rank's kv heads the GiB buy).
        seed: seeds the per-request seeds of requests that give none.
        speculative: a SpeculativeConfig to decode speculatively (lossless), or None for plain decoding.
        speculative_config: vLLM's spelling: a ``SpeculativeConfig``, or vLLM's dict (``{"method": "ngram",
            "num_speculative_tokens": 4}``), read with vLLM's meanings (specdec/config/vllm_compat.py: its "ngram" is
            our prompt lookup). Give ``speculative`` or ``speculative_config``, not both.
        enable_prefix_caching: share the cached KV blocks of a common prompt prefix between requests, so that a
            request computes only what follows the cached prefix (docs/architecture.md, "Prefix caching").
        enforce_eager: run every forward eagerly. False (default): on CUDA, uniform batches - decodes, draft steps,
            verification windows of one length - replay CUDA graphs captured lazily per batch-size bucket (a
            failed capture falls back to eager with a warning); no effect on CPU, which runs eager
            (docs/architecture.md, "CUDA graphs and the static forward"; not yet run on a GPU).
        quantization: None, "int8" (symmetric, per output channel) or "int4" (asymmetric, per group of
            ``quantization_group_size`` input columns, default 32): every linear but an LM head tied to the
            embedding, quantised while loading. A GGUF's Q4_0 / Q4_1 / Q8_0 blocks are kept as they are where the
            format maps exactly (group 32). On CPU int8 runs with per-row int8 activations (specdec's w8a8 kernel,
            else oneDNN's int8 GEMM) and int4 specdec's w4a8 kernel (AVX-512 VNNI; int8 activations per block of
            32) where the CPU has it, else torch's int4 kernel in bf16 (docs/guarantees.md: a quantised target is a
            different target). "gguf" (a .gguf model only): every linear in the format its file stores it in,
            nothing quantised again - Q4_0 / Q4_1 / Q4_K as int4, Q8_0 / Q5_0 / Q6_K / Q5_1 / Q5_K as int8 in
            groups of 32 / 16 (specdec's w4a8 / w8g kernels on CPU), other types (Q2_K, Q3_K, F16, ...) dense
            (docs/guarantees.md, "GGUF blocks as stored").
        quantize_lm_head: None (default): the LM head is quantised with the linears unless it is tied to the
            embedding; True: a tied head too, as its own quantised copy of the embedding's rows (the embedding
            stays for the lookup: more memory, fewer bytes streamed per token); False: the head never is.
        tensor_parallel_size: shard the target (and, by default, a draft model: ``SpeculativeConfig.
            draft_tensor_parallel_size``) over this many ranks - this process and N - 1 worker processes it
            spawns, gloo on CPU, NCCL on CUDA (one GPU per rank); docs/tensor_parallel.md. Call ``shutdown()`` (or
            use the LLM as a context manager) to stop the workers; they are also stopped at exit. With
            ``quantization`` each rank quantises its own shard; int4 / grouped int8 groups must not straddle a shard
            boundary (``ValueError`` naming the allowed group sizes). Under
            ``torchrun`` it must be ``WORLD_SIZE``: nothing is spawned, this call builds the engine on rank 0, and
            on every other rank it serves rank 0 until rank 0 shuts the engine down, then ends the process
            (``SystemExit(0)``; ``TensorParallelError`` if rank 0 dies) - it never returns there.
        batch_invariant: None (default): on a CPU with AMX-BF16 a bfloat16 model runs specdec's row-invariant
            kernels (every bf16 linear and the attention compute each row the same bit for bit whatever else is in
            the forward - a decode, a verification window, a batch, a prefill chunk), so greedy speculative output
            equals plain greedy output and an answer does not depend on its batch (docs/guarantees.md); True: also
            on CPUs with AVX512_BF16 but no AMX, where the GEMM is slower than oneDNN's at 5+ rows (``ValueError``
            where it cannot run: GPUs, float32); False: oneDNN and SDPA, as before.
        distributed_timeout_s: the longest one collective waits for a worker: a worker that dies ends the
            in-flight requests with ``finish_reason "error"`` at once, one that hangs after this many seconds.
    """

    def __init__(
        self,
        model: str | None = None,
        dtype: str | torch.dtype = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        block_size: int = 16,
        max_num_seqs: int = 64,
        max_num_batched_tokens: int | None = None,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float = 1.0,
        seed: int = 0,
        speculative: SpeculativeConfig | None = None,
        prepack_weights: bool | None = None,
        enable_prefix_caching: bool = True,
        enforce_eager: bool = False,
        quantization: str | None = None,
        quantization_group_size: int | None = None,
        tensor_parallel_size: int = 1,
        distributed_timeout_s: float = 60.0,
        quantize_lm_head: bool | None = None,
        batch_invariant: bool | None = None,
        speculative_config: SpeculativeConfig | dict | None = None,
        revision: str | None = None,
        generation_config: str = "auto",
    ):
        if speculative_config is not None:
            if speculative is not None:
                raise ValueError("give speculative or speculative_config (vLLM's name for it), not both")
            speculative = (speculative_config if isinstance(speculative_config, SpeculativeConfig)
                           else speculative_config_from_dict(speculative_config))
        if speculative is not None and not isinstance(speculative, SpeculativeConfig):
            raise ValueError(f"speculative must be a SpeculativeConfig or None, got {type(speculative).__name__}")
        if model is None:
            model = default_model_path()
        config = EngineConfig.create(
            model, dtype=dtype, device=device, max_model_len=max_model_len, block_size=block_size,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens, num_kv_blocks=num_kv_blocks,
            kv_cache_memory_gb=kv_cache_memory_gb, seed=seed,
            lookahead_slots=speculative.tree_nodes(speculative.num_speculative_tokens) if speculative else 0,
            prepack_weights=prepack_weights, enable_prefix_caching=enable_prefix_caching,
            enforce_eager=enforce_eager, quantization=quantization, quantization_group_size=quantization_group_size,
            tensor_parallel_size=tensor_parallel_size, distributed_timeout_s=distributed_timeout_s,
            quantize_lm_head=quantize_lm_head, batch_invariant=batch_invariant, revision=revision,
            generation_config=generation_config,
        )
        self.engine = LLMEngine(config, speculative)
        self.last_stream_output: RequestOutput | None = None  # the final output of the last stream() call

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def get_default_sampling_params(self) -> SamplingParams:
        """``SamplingParams()`` with the model's defaults from its ``generation_config.json`` (temperature, top_k,
        top_p, min_p, repetition_penalty, max_new_tokens as max_tokens; vLLM's reading) unless
        ``LLM(generation_config="none")``: what ``generate`` / ``chat`` / ``stream`` use when given no params."""
        return SamplingParams(**self.engine.config.sampling_defaults)

    def shutdown(self) -> None:
        """Stop the tensor-parallel workers (nothing to do with ``tensor_parallel_size=1``); never hangs."""
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def generate(
        self,
        prompts: str | list[str] | None = None,
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        *,
        prompt_token_ids: list[int] | list[list[int]] | None = None,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """Generate for every prompt (text or token ids); outputs in input order. ``tenant``: who sends them
        (``LLMEngine.add_request``; scopes the suffix drafter's index).

        Every request is validated before any runs: one bad request raises ``ValueError`` (naming its index) and
        nothing is queued. A request that fails while running ends with ``finish_reason == "error"`` and its
        message in ``RequestOutput.error``; the others are unaffected. A request with ``n > 1`` returns one
        ``RequestOutput`` with ``outputs[i]`` for sample i.
        """
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        requests = self._requests(prompts, sampling_params, prompt_token_ids)
        for i, (prompt, params, ids) in enumerate(requests):
            try:
                self.engine.validate_request(prompt, ids, params)
            except ValueError as e:
                if len(requests) == 1:
                    raise
                raise ValueError(f"prompt {i} of {len(requests)}: {e}") from None
        request_ids = [self.engine.add_request(prompt, params, ids, tenant=tenant) for prompt, params, ids in requests]
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        return [final[rid] for rid in request_ids]

    def stream(
        self, prompt: str | None = None, sampling_params: SamplingParams | None = None, *,
        prompt_token_ids: list[int] | None = None, tenant: str | None = None,
    ) -> Iterator[str]:
        """Yield text deltas of one request as they become safe to show (no partial UTF-8, no stop prefix).

        One text, so ``sampling_params.n`` must be 1 (``ValueError`` otherwise): for n > 1 samples use
        ``generate()``, or ``engine.step()``, whose outputs carry every sample's cumulative text by index."""
        if sampling_params is not None and getattr(sampling_params, "n", 1) != 1:
            raise ValueError(f"LLM.stream yields the text of one sample; SamplingParams.n={sampling_params.n!r} "
                             "is not allowed here (use n=1, or generate() / engine.step() for n > 1)")
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        rid = self.engine.add_request(prompt, sampling_params, prompt_token_ids, tenant=tenant)
        self.last_stream_output = None
        shown = 0
        try:
            while True:
                outs = [o for o in self.engine.step() if o.request_id == rid]
                for out in outs:
                    text = out.outputs[0].text
                    if len(text) > shown:
                        yield text[shown:]
                        shown = len(text)
                    if out.finished:
                        self.last_stream_output = out
                        return
                if not self.engine.has_unfinished_requests():
                    return
        finally:
            self.engine.abort(rid)

    def chat(
        self,
        messages: list[dict] | list[list[dict]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
        add_generation_prompt: bool = True,
        chat_template: str | None = None,
        chat_template_kwargs: dict | None = None,
        tenant: str | None = None,
    ) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (or a list of them) and generate. ``chat_template``:
        a template's text, or the name of one of the model's named templates, instead of its default;
        ``chat_template_kwargs``: more variables for the template (vLLM's arguments of the same names); ``tenant``:
        as for :meth:`generate`."""
        if self.tokenizer is None:
            raise ValueError("this model folder has no tokenizer.json, so chat() cannot render a conversation")
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [self.tokenizer.apply_chat_template(c, add_generation_prompt, chat_template=chat_template,
                                                      chat_template_kwargs=chat_template_kwargs)
                   for c in conversations]
        return self.generate(prompts, sampling_params, tenant=tenant)

    @staticmethod
    def _requests(prompts, sampling_params, prompt_token_ids) -> list[tuple[str | None, SamplingParams, list | None]]:
        """(text, params, token ids) per request, or ``ValueError`` naming the argument - and the index in a
        batch - that is wrong, and the type that was actually passed."""
        if (prompts is None) == (prompt_token_ids is None):
            raise ValueError("give exactly one of prompts or prompt_token_ids")
        if prompts is not None:
            if isinstance(prompts, str):
                prompts = [prompts]
            if not isinstance(prompts, (list, tuple)):
                raise ValueError(f"prompts must be a string or a list of strings, got {type(prompts).__name__}")
            texts = list(prompts)
            id_lists: list = [None] * len(texts)
        else:
            if not isinstance(prompt_token_ids, (list, tuple)):
                raise ValueError("prompt_token_ids must be a list of ints or a list of lists of ints, got "
                                 f"{type(prompt_token_ids).__name__}")
            single = bool(prompt_token_ids) and not isinstance(prompt_token_ids[0], (list, tuple))
            id_lists = [list(prompt_token_ids)] if single else list(prompt_token_ids)
            texts = [None] * len(id_lists)
        if not texts:
            raise ValueError("no prompts given")
        if sampling_params is None:
            params = [SamplingParams()] * len(texts)
        elif isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(texts)
        elif isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
            if len(params) != len(texts):
                raise ValueError(f"got {len(params)} sampling_params for {len(texts)} prompts; give one, or one each")
            for i, p in enumerate(params):
                if not isinstance(p, SamplingParams):
                    raise ValueError(f"sampling_params[{i}] must be a SamplingParams, got {type(p).__name__}")
        else:
            raise ValueError("sampling_params must be a SamplingParams or a list of them (one per prompt), got "
                             f"{type(sampling_params).__name__}")
        return list(zip(texts, params, id_lists))
