"""Recycled candidates, method "recycle" (Token Recycling, Luo et al. 2024): draft from the target's own top-W
next-token candidates, kept per token id from earlier forwards, at no extra forward.

Every engine step already computes the target's logits at each row it verifies or decodes. The step hands the top
``candidate_width`` ids of every row to the proposer (one ``topk`` on the device, read with the step's one host
read; ``engine/step.py``), and the proposer stores them as the row of an adjacency matrix ``M[token]`` - "after
``token``, the target last ranked these W tokens highest" - overwriting what was there (the latest context wins).
Rows of rejected drafts count too: their logits are the target's own, only at a context that was not kept.

Drafting reads ``M`` only:

- ``propose`` (chain): from the request's last token follow ``M[t][0]``, up to k tokens; a token with no row stops
  the chain (no row at the last token: no drafts, a plain step).
- ``propose_tree``: best-first under the node budget, the chain kept first (``token_trie.best_first_tree``); a
  node's children are ``M[t][0..W-1]``, child j ranked by its path's prior probability ``prod RANK_PRIOR[j]`` (the
  j-th candidate is right less often than the (j-1)-th).

Drafts are one-hot (q is a point mass at each token; a node's children are distinct ids), so tree verification
keeps sampled requests lossless as for the prompt-lookup tries.

Scope (``SpeculativeConfig.recycle_scope``): "engine" (default, as the paper keeps its matrix across queries) - one
matrix for every request of the engine: what one request's target forwards ranked drafts another's (the drafts are
verified, so the output never changes; only speed depends on it); "request" - a matrix per request, started empty,
forgotten when it finishes.
"""

from __future__ import annotations

import numpy as np

from specdec.config.speculative import RECYCLE_SCOPES
from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.token_trie import best_first_tree, check_tree_budgets, tree_proposal
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree

# the prior probability that a node's j-th candidate is the token the target keeps (j = 0, 1, ...): it only orders
# the nodes of a tree under its budget (a path's rank is the product along it), never what is accepted
RANK_PRIOR = (0.5, 0.2, 0.1, 0.06, 0.04, 0.03, 0.02, 0.015)


class CandidateMatrix:
    """``M``: int32 ``[V, W]``, row t = the target's top-W ids after token t at its latest forward row (-1: none).

    Args:
        vocab_size: V, the target's vocabulary (token ids outside ``[0, V)`` are ignored on update).
        width: W, the candidates kept per token.
    """

    def __init__(self, vocab_size: int, width: int):
        self.width = width
        self.rows = np.full((vocab_size, width), -1, dtype=np.int32)  # [V, W]

    def update(self, tokens: np.ndarray, candidates: np.ndarray) -> None:
        """``M[tokens[i]] = candidates[i]`` in order (a token seen twice keeps its last row).

        Args:
            tokens: int64 ``[R]``, the input token of each forward row.
            candidates: int64 ``[R, W]``, the target's top-W ids of that row's logits, best first.
        """
        keep = (tokens >= 0) & (tokens < self.rows.shape[0])
        # numpy's fancy assignment with repeated indices keeps the last value: the latest row wins
        self.rows[tokens[keep]] = candidates[keep]

    def chain(self, token: int, k: int) -> list[int]:
        """Up to ``k`` tokens following ``M[t][0]`` from ``token``."""
        out: list[int] = []
        while len(out) < k:
            nxt = int(self.rows[token, 0])
            if nxt < 0:
                break
            out.append(nxt)
            token = nxt
        return out

    def tree(self, root: int, max_depth: int, max_nodes: int, max_children: int) -> DraftTree:
        """A draft tree from ``root`` (depth ``<= max_depth``, ``<= max_nodes`` drafts, ``<= max_children`` per node),
        the ``chain`` kept first, then the nodes of highest prior path probability."""
        if max_depth <= 0 or max_nodes <= 0:
            return DraftTree((root,), (-1,))
        width = min(max_children, self.width, len(RANK_PRIOR))

        def expand(state: tuple[int, float]) -> list[tuple[int, tuple, tuple[int, float]]]:
            token, prob = state
            out = []
            for j, cand in enumerate(self.rows[token, :width].tolist()):
                if cand < 0:
                    break
                p = prob * RANK_PRIOR[j]
                out.append((cand, (-p,), (cand, p)))
            return out

        return best_first_tree(root, (root, 1.0), expand, max_depth, max_nodes, self.chain(root, max_depth))


class RecycleProposer(ModelFreeProposer):
    """Model-free drafter over :class:`CandidateMatrix` (module docstring); drafts are one-hot.

    Args:
        vocab_size: the target's vocabulary size.
        width: candidates kept per token id (W) - also the most children of one tree node.
        scope: "engine" (one matrix for every request) or "request" (one per request).
    """

    def __init__(self, vocab_size: int, width: int = 4, scope: str = "engine"):
        if scope not in RECYCLE_SCOPES:
            raise ValueError(f"recycle_scope {scope!r} is not supported; supported: {RECYCLE_SCOPES}")
        self.vocab_size, self.scope = vocab_size, scope
        self.candidate_width = width  # the step hands over the top-W ids of every logits row (engine/step.py)
        self.shared = CandidateMatrix(vocab_size, width) if scope == "engine" else None
        self.per_request: dict[int, CandidateMatrix] = {}

    def take_candidates(self, seq_ids: list[int], tokens: list[int], candidates: list[list[int]]) -> None:
        """The step's rows: row i was computed for request ``seq_ids[i]`` with input token ``tokens[i]``;
        ``candidates[i]``: its top-W ids, best first."""
        if not tokens:
            return
        toks = np.asarray(tokens, dtype=np.int64)
        cands = np.asarray(candidates, dtype=np.int64).reshape(len(tokens), self.candidate_width)
        if self.shared is not None:
            self.shared.update(toks, cands)
            return
        ids = np.asarray(seq_ids)
        for seq_id in dict.fromkeys(seq_ids):
            rows = ids == seq_id
            self._matrix(seq_id).update(toks[rows], cands[rows])

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        drafts = [self._matrix(seq.seq_id).chain(seq.last_token_id, k) if k > 0 else []
                  for seq, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request a tree of recycled candidates (depth ``<= max_depths[i]``, ``<= max_nodes[i]`` drafts);
        one-hot, no q."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        return tree_proposal([self._matrix(seq.seq_id).tree(seq.last_token_id, d, n, self.candidate_width)
                              for seq, d, n in zip(seqs, max_depths, max_nodes)])

    def _matrix(self, seq_id: int) -> CandidateMatrix:
        if self.shared is not None:
            return self.shared
        matrix = self.per_request.get(seq_id)
        if matrix is None:
            matrix = self.per_request[seq_id] = CandidateMatrix(self.vocab_size, self.candidate_width)
        return matrix

    def free(self, seq_id: int, finished: bool) -> None:
        if finished:  # a preempted request keeps its matrix: its tokens come back as they were
            self.per_request.pop(seq_id, None)
