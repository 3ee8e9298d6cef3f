"""RequestView: what the speculative-decoding layer reads of a request.

Proposers and the round's bookkeeping see a request through this protocol only, never the engine's ``Sequence``
(which is one): they cannot change a request, and the layer below the engine never imports it. Everything here is
read-only; the token lists grow as the engine commits tokens.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np

from specdec.sampling.params import SamplingParams
from specdec.structured.grammar import GrammarState


class RequestView(Protocol):
    seq_id: int  # the engine's id for the request (one sample of it when n > 1); keys per-request state
    request_id: str  # the user's id, named in errors
    params: SamplingParams
    seed: int  # the request's randomness key
    num_computed: int  # tokens whose K/V are in the target cache (committed)
    grammar: GrammarState | None  # structured outputs: the grammar state after the committed output, or None
    tenant: str | None  # who sent it (``LLM.generate(tenant=)``; serve: the API key): scopes shared draft state

    @property
    def prompt_token_ids(self) -> list[int]: ...

    @property
    def output_token_ids(self) -> list[int]: ...

    @property
    def all_token_ids(self) -> list[int]: ...  # prompt + output

    @property
    def token_array(self) -> np.ndarray: ...  # prompt + output as int64 [num_tokens]

    @property
    def last_token_id(self) -> int: ...

    @property
    def num_tokens(self) -> int: ...  # len(prompt) + len(output): the position of the first draft

    def penalty_counts(self, extra: list[int] = ()) -> tuple[np.ndarray, np.ndarray]:
        """(ids int64 [D], counts int32 [D]): the penalty context after output + ``extra``."""
        ...
