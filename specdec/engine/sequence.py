"""A request's state as it moves through the engine."""

from __future__ import annotations

import enum
import time
from dataclasses import InitVar, dataclass, field, fields

import numpy as np

from specdec.engine.token_history import TokenHistory
from specdec.sampling.params import SamplingParams
from specdec.structured.grammar import GrammarState


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Per-request counters and times (definitions in docs/metrics.md)."""

    arrival_time: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finished_time: float | None = None
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission (not computed)
    num_generated_tokens: int = 0
    num_preemptions: int = 0
    target_forwards: int = 0  # target forwards this request took part in (prefill chunks included)
    draft_forwards: int = 0
    # speculative decoding (zero for plain decoding)
    num_rounds: int = 0  # verification rounds
    num_drafted: int = 0
    num_accepted: int = 0
    num_rejected_rounds: int = 0  # rounds that ended in a rejection
    num_round_tokens: int = 0  # tokens emitted by verification rounds (accepted + correction/bonus)
    accepted_per_position: list[int] = field(default_factory=list)  # [k_max] accepted draft i
    drafted_per_position: list[int] = field(default_factory=list)  # [k_max] drafted draft i
    k_per_step: list[int] = field(default_factory=list)  # speculation length granted at each decode step

    def record_round(self, drafted: int, accepted: int, emitted: int) -> None:
        """A verification round: ``drafted`` drafts (a tree: its depth), the first ``accepted`` accepted, ``emitted``
        tokens kept after stop truncation (accepted + correction or bonus, at most)."""
        self.num_rounds += 1
        self.num_drafted += drafted
        self.num_accepted += accepted
        self.num_rejected_rounds += accepted < drafted
        self.num_round_tokens += emitted
        grow = drafted - len(self.drafted_per_position)
        if grow > 0:
            self.drafted_per_position += [0] * grow
            self.accepted_per_position += [0] * grow
        for i in range(drafted):
            self.drafted_per_position[i] += 1
            self.accepted_per_position[i] += i < accepted

    @property
    def acceptance_rate(self) -> float | None:
        """accepted / drafted (vLLM's system metric)."""
        return self.num_accepted / self.num_drafted if self.num_drafted else None

    @property
    def alpha(self) -> float | None:
        """accepted / (accepted + rounds ending in a rejection): the per-token acceptance estimator."""
        denom = self.num_accepted + self.num_rejected_rounds
        return self.num_accepted / denom if denom else None

    @property
    def mean_tokens_per_round(self) -> float | None:
        """tau: tokens emitted by verification rounds / rounds (bonus and correction tokens included)."""
        return self.num_round_tokens / self.num_rounds if self.num_rounds else None

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / d if d else 0.0 for a, d in zip(self.accepted_per_position, self.drafted_per_position)]

    @property
    def wall_time(self) -> float | None:
        return self.finished_time - self.arrival_time if self.finished_time is not None else None

    @classmethod
    def merged(cls, parts: list[RequestMetrics]) -> RequestMetrics:
        """The metrics of a request with ``n > 1`` samples (docs/metrics.md): counters summed over the samples
        (the prompt counted once), per-position lists summed elementwise, ``k_per_step`` concatenated in sample
        order; arrival and first token the earliest, finish the latest (None while a sample runs)."""
        out = cls()
        for f in fields(cls):
            values = [getattr(m, f.name) for m in parts]
            if f.name in ("num_prompt_tokens", "num_cached_tokens"):  # the prompt once (sample 0's cache hit)
                merged = values[0]
            elif f.name in ("arrival_time", "first_token_time"):
                known = [v for v in values if v is not None]
                merged = min(known) if known else None
            elif f.name == "finished_time":
                merged = None if any(v is None for v in values) else max(values)
            elif f.name == "k_per_step":
                merged = [k for v in values for k in v]
            elif isinstance(values[0], list):
                width = max(len(v) for v in values)
                merged = [sum(v[i] for v in values if i < len(v)) for i in range(width)]
            else:
                merged = sum(values)
            setattr(out, f.name, merged)
        return out

    def as_dict(self) -> dict:
        return {
            "num_prompt_tokens": self.num_prompt_tokens,
            "num_cached_tokens": self.num_cached_tokens,
            "num_generated_tokens": self.num_generated_tokens,
            "num_preemptions": self.num_preemptions,
            "target_forwards": self.target_forwards,
            "draft_forwards": self.draft_forwards,
            "num_rounds": self.num_rounds,
            "drafted": self.num_drafted,
            "accepted": self.num_accepted,
            "acceptance_rate": self.acceptance_rate,
            "alpha": self.alpha,
            "mean_tokens_per_round": self.mean_tokens_per_round,
            "per_position_acceptance": self.per_position_acceptance,
            "k_per_step": list(self.k_per_step),
            "time_to_first_token": (self.first_token_time - self.arrival_time) if self.first_token_time else None,
            "wall_time": self.wall_time,
        }


@dataclass(eq=False)  # identity equality: `seq in running` must be O(1) per comparison
class Sequence:
    """One request (one sample of it when ``n > 1``) as the engine sees it.

    Its tokens live in a :class:`TokenHistory`: ``prompt_token_ids``, ``output_token_ids`` and ``all_token_ids``
    are read-only lists that grow with it, ``token_array`` the same as int64, and ``penalty_counts`` the distinct
    tokens with their output counts - all O(1) or O(distinct) to read. :meth:`append_token` is the only way a
    token is added. A ``Sequence`` is a ``RequestView`` (specdec/spec_decode/request.py): what proposers and
    verification read of a request.
    """

    seq_id: int
    request_id: str
    prompt: str | None
    prompt_ids: InitVar[list[int]]
    params: SamplingParams
    seed: int  # the request's randomness key (docs/architecture.md, randomness contract)
    eos_token_ids: frozenset[int]
    status: Status = Status.WAITING
    num_computed: int = 0  # tokens whose K/V are in the target cache
    lookahead: int = 0  # extra slots the scheduler granted this step (the speculation budget: chain length or nodes)
    finish_reason: str | None = None
    error: str | None = None  # why the request failed (finish_reason "error")
    metrics: RequestMetrics = field(default_factory=RequestMetrics)
    # logprobs (params.logprobs is not None): one {token id: log-probability} per output token, aligned with
    # output_token_ids; None when not asked for
    logprobs: list[dict[int, float]] | None = None
    cumulative_logprob: float = 0.0  # sum of the output tokens' own log-probabilities (when logprobs are kept)
    # n > 1: this sequence is sample ``index`` of the request ``parent_id`` (its own request_id is internal)
    parent_id: str | None = None
    index: int = 0
    # structured outputs: the grammar state after the committed output (specdec/structured/grammar.py), or None
    grammar: GrammarState | None = None
    # who sent the request (LLM.generate(tenant=); serve: the API key): scopes state shared across requests (the
    # suffix drafter's index), None = the anonymous tenant
    tenant: str | None = None
    # detokenisation state (engine/detokenizer.py)
    output_text: str = ""
    stable_text_len: int = 0  # prefix of output_text that streaming may show
    prefix_offset: int = 0
    read_offset: int = 0

    def __post_init__(self, prompt_ids: list[int]) -> None:
        self.history = TokenHistory(prompt_ids)

    def append_token(self, token: int) -> None:
        """Add one generated token (O(1) amortised): the output, the history buffer and the penalty counts, and
        the grammar state (``ValueError`` if the grammar refuses the token: the token is not added)."""
        if self.grammar is not None:
            self.grammar.accept(token)
        self.history.append(token)

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (read-only)."""
        return self.history.prompt

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens so far (read-only; grows with :meth:`append_token`)."""
        return self.history.output

    @property
    def all_token_ids(self) -> list[int]:
        """prompt + output: a read-only list that grows with the sequence (O(1); ``list(...)`` for a snapshot)."""
        return self.history.tokens

    @property
    def token_array(self) -> np.ndarray:
        """prompt + output as int64 ``[num_tokens]`` (a read-only view, valid until the next token is added)."""
        return self.history.array

    def penalty_counts(self, extra: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """The penalty context of the position after output + ``extra`` (drafts before a draft position):
        ``(ids int64 [D], counts int32 [D])``, each distinct token once with its count in output + ``extra``."""
        return self.history.penalty_counts(extra)

    @property
    def last_token_id(self) -> int:
        return self.history.tokens[-1]

    @property
    def num_tokens(self) -> int:
        return len(self.history)

    @property
    def is_finished(self) -> bool:
        return self.status == Status.FINISHED
