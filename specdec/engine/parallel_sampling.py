"""Parallel sampling (``SamplingParams.n > 1``): n sequences of one prompt, reported as one request.

Sample i is an ordinary sequence with its own internal id ``"<request id>#<i>"`` and seed ``child_seed(seed, i)``
(sample 0 = the n == 1 request; an unseeded request draws n seeds). The engine steps them like any request; this
module fans a request out into its samples and merges their outputs back into one ``RequestOutput`` per request,
``outputs[i]`` for sample i.
"""

from __future__ import annotations

import dataclasses

from specdec.engine.output_processor import completion
from specdec.engine.sequence import RequestMetrics, Sequence
from specdec.outputs import RequestOutput
from specdec.sampling.params import SamplingParams, child_seed


def sample_ids(request_id: str, n: int) -> list[str]:
    """The internal ids of a request's samples (the request id itself when n == 1)."""
    return [request_id] if n == 1 else [f"{request_id}#{i}" for i in range(n)]


def sample_params(params: SamplingParams, index: int, seed: int) -> SamplingParams:
    """Sample ``index``'s own params: n = 1, and its own seed when the request was seeded."""
    if params.n == 1:
        return params
    return dataclasses.replace(params, n=1, seed=None if params.seed is None else seed)


def sample_seed(params: SamplingParams, index: int, draw: int) -> int:
    """Sample ``index``'s randomness key: derived from the request's seed, or ``draw`` (a fresh random key)."""
    return child_seed(params.seed, index) if params.seed is not None else draw


class SampleGroups:
    """The requests with n > 1 that are still reported: their samples, and each sample's request."""

    def __init__(self):
        self._groups: dict[str, list[Sequence]] = {}  # request id -> its samples, in index order
        self._request_of: dict[str, str] = {}  # a sample's internal id -> its request id

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._groups

    def add(self, request_id: str, samples: list[Sequence]) -> None:
        for i, seq in enumerate(samples):
            seq.parent_id, seq.index = request_id, i
            self._request_of[seq.request_id] = request_id
        self._groups[request_id] = samples

    def request_of(self, request_id: str) -> str:
        """The request a sample's internal id belongs to (any other id: itself)."""
        return self._request_of.get(request_id, request_id)

    def samples(self, request_id: str) -> list[Sequence] | None:
        return self._groups.get(request_id)

    def output(self, request_id: str) -> RequestOutput:
        """One ``RequestOutput`` for all samples of ``request_id``: ``outputs[i]`` is sample i (cumulative, every
        sample every time); finished when all are; ``error`` lists the samples that failed."""
        seqs = self._groups[request_id]
        errors = [f"output {s.index}: {s.error}" for s in seqs if s.error is not None]
        return RequestOutput(
            request_id=request_id,
            prompt=seqs[0].prompt,
            prompt_token_ids=seqs[0].prompt_token_ids,
            outputs=[completion(s) for s in seqs],
            finished=all(s.is_finished for s in seqs),
            metrics=RequestMetrics.merged([s.metrics for s in seqs]).as_dict(),
            error="; ".join(errors) if errors else None,
        )

    def merge(self, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Replace the outputs of samples by their request's output, once per request, at the place of its first
        sample; a request whose samples have all finished is forgotten after its final output."""
        merged: list[RequestOutput] = []
        groups: list[str] = []
        for out in outputs:
            parent = self._request_of.get(out.request_id)
            if parent is None:
                merged.append(out)
            elif parent not in groups:
                groups.append(parent)
                merged.append(self.output(parent))
        for parent in groups:
            if all(s.is_finished for s in self._groups[parent]):
                self.forget(parent)
        return merged

    def forget(self, request_id: str) -> None:
        for seq in self._groups.pop(request_id):
            self._request_of.pop(seq.request_id, None)
