"""SamplingParams: what a request asks of the sampler, validated on construction (vLLM's shape)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from specdec.structured.params import StructuredOutputsParams

MAX_SEED = 2**63 - 1  # seeds travel as int64 tensors (the Philox key); the engine draws unseeded ones below it
MAX_LOGPROBS = 20  # top alternatives per token: OpenAI's top_logprobs limit and vLLM's default max_logprobs
MAX_N = 128  # samples per request: OpenAI's limit for n; each sample is a full sequence in the batch


@dataclass
class SamplingParams:
    """Per-request sampling settings.

    ``temperature == 0`` is greedy (argmax of the penalised logits). Penalties follow vLLM/OpenAI:
    ``repetition_penalty`` (> 0, 1 = off) divides positive / multiplies negative logits of every token seen in
    prompt or output; ``presence_penalty`` / ``frequency_penalty`` (in [-2, 2]) subtract a constant / a
    count-proportional amount for tokens already generated. ``seed`` (in [0, 2**63 - 1]) makes the request's
    random numbers a pure function of (seed, position, stream); what that reproduces is in docs/architecture.md.

    ``logprobs`` (None or 0..20): None returns no log-probabilities; 0 the sampled token's; N > 0 also the N
    most likely tokens' - each the log-softmax of the target's raw logits, before penalties, temperature and
    filtering (docs/metrics.md); under ``structured_outputs``, of those logits after the grammar's mask. ``n``
    (1..128): independent samples of the prompt, returned as ``outputs[0..n)`` of one ``RequestOutput``; sample
    i > 0 uses the seed :func:`child_seed` derives from ``seed``.

    ``structured_outputs`` (a :class:`~specdec.structured.StructuredOutputsParams` or a dict of its fields, vLLM's
    shape): the output is constrained to a JSON schema, any JSON object, a regex, a choice or a Lark grammar; the
    mask applies to the raw logits before penalties, temperature and filtering (docs/api.md, "Structured outputs").
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    max_tokens: int = 16
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    seed: int | None = None
    logprobs: int | None = None
    n: int = 1
    structured_outputs: StructuredOutputsParams | dict | None = None
    stop_strings: tuple[str, ...] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, allowed: str) -> ValueError:
            return ValueError(f"SamplingParams.{name}={getattr(self, name)!r} is invalid; allowed: {allowed}")

        def is_int(x) -> bool:
            return isinstance(x, int) and not isinstance(x, bool)

        def is_num(x) -> bool:
            return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)

        if not is_num(self.temperature) or self.temperature < 0:
            raise bad("temperature", "a finite number >= 0 (0 = greedy)")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool) or self.top_k < 0:
            raise bad("top_k", "an integer >= 0 (0 = off)")
        if not is_num(self.top_p) or not 0 < self.top_p <= 1:
            raise bad("top_p", "a number in (0, 1] (1 = off)")
        if not is_num(self.min_p) or not 0 <= self.min_p <= 1:
            raise bad("min_p", "a number in [0, 1] (0 = off)")
        if not is_num(self.repetition_penalty) or self.repetition_penalty <= 0:
            raise bad("repetition_penalty", "a number > 0 (1 = off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not is_num(value) or not -2 <= value <= 2:
                raise bad(name, "a number in [-2, 2] (0 = off)")
        if not isinstance(self.max_tokens, int) or isinstance(self.max_tokens, bool) or self.max_tokens < 1:
            raise bad("max_tokens", "an integer >= 1")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed <= MAX_SEED):
            raise bad("seed", f"None or an integer in [0, 2**63 - 1] = [0, {MAX_SEED}] (Philox takes a 64-bit key)")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if not all(isinstance(s, str) and s for s in stops):
            raise bad("stop", "a non-empty string or a list of non-empty strings")
        self.stop_strings = tuple(stops)
        ids = list(self.stop_token_ids or [])
        if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
            raise bad("stop_token_ids", "a list of non-negative token ids")
        self.stop_token_ids = ids
        if self.logprobs is not None and (not is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise bad("logprobs", f"None (none), or an integer in [0, {MAX_LOGPROBS}]: 0 = the sampled token's "
                                  "log-probability only, N = also the N most likely tokens'")
        if not is_int(self.n) or not 1 <= self.n <= MAX_N:
            raise bad("n", f"an integer in [1, {MAX_N}] (independent samples of the prompt)")
        if isinstance(self.structured_outputs, dict):
            self.structured_outputs = StructuredOutputsParams.from_dict(self.structured_outputs)
        elif self.structured_outputs is not None and not isinstance(self.structured_outputs,
                                                                    StructuredOutputsParams):
            raise bad("structured_outputs", "None, a StructuredOutputsParams or a dict of its fields (json, "
                                            "json_object, regex, choice, grammar)")

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return self.repetition_penalty != 1 or self.presence_penalty != 0 or self.frequency_penalty != 0

    @property
    def needs_host_drafts(self) -> bool:
        """A draft model must bring its drafts to the host every draft step: the penalty context and the grammar
        state of a draft position depend on the drafts before it."""
        return self.has_penalties or self.structured_outputs is not None


def child_seed(seed: int, index: int) -> int:
    """The seed of sample ``index`` of a request with ``n > 1`` and seed ``seed``, in [0, 2**63 - 1].

    Sample 0 keeps ``seed`` (so it reproduces the ``n == 1`` request); sample i > 0 takes the top 63 bits of
    ``splitmix64(seed + i * 0x9E3779B97F4A7C15 mod 2**64)`` (Steele et al.'s SplitMix64 finaliser): a
    deterministic, well-mixed function of (seed, i), so samples of one request do not share random streams.
    """
    if index == 0:
        return seed
    mask = 2**64 - 1
    z = (seed + index * 0x9E3779B97F4A7C15) & mask
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
    return (z ^ (z >> 31)) >> 1
