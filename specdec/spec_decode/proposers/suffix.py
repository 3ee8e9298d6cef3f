"""Suffix drafting across requests, method "suffix" (SuffixDecoding, Oliaro et al. 2024): draft what followed the
context's suffix in the request's own text and in the outputs of earlier requests of the same tenant.

Two sources of matches, each a position whose preceding tokens equal the last n tokens of the request's text
(``MIN_MATCH <= n <= MAX_MATCH``):

- **the request itself** (its prompt and output so far): prompt lookup's matcher (``prompt_lookup.lookup_matches``);
- **the tenant's index** (:class:`SuffixIndex`): the outputs of its finished requests, looked up through a table
  from the last ``KEY_LEN`` tokens to the positions that follow them, bounded by ``max_tokens`` (oldest outputs
  evicted first).

Matches rank by length (longer first), then source (the request's own first), then recency; the best
``MAX_MATCHES`` are merged into a token trie whose nodes are ranked by support (matches through them), as prompt
lookup's trees are. The draft's depth adapts to the evidence: at most ``SPEC_FACTOR x`` the best match's length
(a 2-token match drafts 4 tokens, a 16-token one up to the round's k), as SuffixDecoding caps its speculation by the
match length. ``propose`` (chain) is the best match's continuation; ``propose_tree`` the trie, best-first under the
node budget with the chain kept first (``token_trie.best_first_tree``). Drafts are one-hot.

**Tenants.** Every request carries a tenant (``LLM.generate(tenant=)``; ``specdec serve`` derives it from the API key
the request authenticated with, docs/api.md): only requests of the same tenant share an index, so one tenant's
drafts - and so its speed - never depend on another's text. ``SpeculativeConfig(suffix_scope="global")`` shares
one index across tenants (opt-in).

The index is updated only when a request finishes (``free(finished=True)``) with the tokens it emitted; a preempted
request is not indexed. The engine is single-threaded, so no lock is needed; n > 1 samples are separate requests and
each is indexed.
"""

from __future__ import annotations

from collections import OrderedDict

from specdec.spec_decode.proposers.base import DraftProposal, ModelFreeProposer
from specdec.spec_decode.proposers.prompt_lookup import lookup_matches
from specdec.spec_decode.proposers.token_trie import check_tree_budgets, support_trie, tree_proposal
from specdec.spec_decode.request import RequestView
from specdec.spec_decode.tree import DraftTree

KEY_LEN = 2  # tokens of context that key the index (a match is at least this long)
MIN_MATCH = 2  # the shortest match drafted from
MAX_MATCH = 32  # matches are measured up to this many tokens
MAX_MATCHES = 16  # matches merged into a tree
MAX_CANDIDATES = 256  # index positions examined per lookup (the most recent ones)
SPEC_FACTOR = 2  # draft depth <= SPEC_FACTOR x the best match's length


class SuffixIndex:
    """The outputs of one tenant's finished requests, looked up by their last ``KEY_LEN`` tokens.

    Args:
        max_tokens: the most tokens kept; adding past it evicts the oldest outputs whole.
    """

    def __init__(self, max_tokens: int):
        self.max_tokens = max_tokens
        self.docs: OrderedDict[int, list[int]] = OrderedDict()  # doc id -> its tokens, oldest first
        self.table: dict[tuple[int, ...], list[tuple[int, int]]] = {}  # key -> [(doc id, position after the key)]
        self.num_tokens = 0
        self._next_id = 0
        self._dead_entries = 0  # table entries of evicted docs, dropped at the next compaction

    def add(self, tokens: list[int]) -> None:
        """Index ``tokens`` (one finished output); evict the oldest outputs beyond ``max_tokens``."""
        if len(tokens) <= KEY_LEN or len(tokens) > self.max_tokens:
            return
        doc = self._next_id
        self._next_id += 1
        self.docs[doc] = list(tokens)
        for pos in range(KEY_LEN, len(tokens)):
            self.table.setdefault(tuple(tokens[pos - KEY_LEN:pos]), []).append((doc, pos))
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens:
            _, old = self.docs.popitem(last=False)
            self.num_tokens -= len(old)
            self._dead_entries += max(0, len(old) - KEY_LEN)
        if self._dead_entries > self.num_tokens:  # more dead entries than live ones: compact
            self._compact()

    def _compact(self) -> None:
        live = self.docs
        self.table = {key: kept for key, entries in self.table.items()
                      if (kept := [e for e in entries if e[0] in live])}
        self._dead_entries = 0

    def matches(self, context: list[int]) -> list[tuple[int, int, list[int]]]:
        """``(length, recency, continuation)`` of the index positions whose preceding tokens match the end of
        ``context``: length ``>= MIN_MATCH`` (up to ``MAX_MATCH``), the continuation up to ``MAX_MATCH`` tokens,
        recency = the doc id (later = newer); at most ``MAX_CANDIDATES`` positions examined, newest first."""
        if len(context) < KEY_LEN:
            return []
        entries = self.table.get(tuple(context[-KEY_LEN:]))
        if not entries:
            return []
        out = []
        span = min(MAX_MATCH, len(context))
        for doc, pos in reversed(entries[-MAX_CANDIDATES:]):
            tokens = self.docs.get(doc)
            if tokens is None:  # evicted
                continue
            n = KEY_LEN
            while n < span and pos - n - 1 >= 0 and tokens[pos - n - 1] == context[-n - 1]:
                n += 1
            if n >= MIN_MATCH:  # pos < len(tokens): a position is indexed only when a token follows it
                out.append((n, doc, tokens[pos:pos + MAX_MATCH]))
        return out


Match = tuple[int, int, list[int]]  # (length, recency, continuation)


def rank_matches(own: list[Match], shared: list[Match]) -> list[list[int]]:
    """The continuations of the best ``MAX_MATCHES`` matches, best first: longer, then the request's own, then
    more recent; each cut to ``SPEC_FACTOR x`` the best match's length (the draft's depth cap)."""
    ranked = sorted([(n, 1, r, c) for n, r, c in own] + [(n, 0, r, c) for n, r, c in shared],
                    key=lambda m: (-m[0], -m[1], -m[2]))[:MAX_MATCHES]
    if not ranked:
        return []
    depth = SPEC_FACTOR * ranked[0][0]
    return [c[:depth] for *_, c in ranked]


def suffix_chain(conts: list[list[int]], k: int) -> list[int]:
    """Up to ``k`` tokens: the best match's continuation (``rank_matches``' first)."""
    return conts[0][:k] if conts and k > 0 else []


def suffix_tree(root: int, conts: list[list[int]], max_depth: int, max_nodes: int) -> DraftTree:
    """The trie of the ranked continuations ``conts`` (``rank_matches``), depth ``<= max_depth``, at most
    ``max_nodes`` drafts: the chain first, then the nodes most matches pass through (ties: the better match)."""
    if not conts or max_depth <= 0 or max_nodes <= 0:
        return DraftTree((root,), (-1,))
    # a node's support: the matches through it; ties go to the better-ranked match
    return support_trie(root, [(cont, 1, rank) for rank, cont in enumerate(conts)], max_depth, max_nodes,
                        conts[0][:max_depth])


class SuffixProposer(ModelFreeProposer):
    """Model-free drafter over the request's own text and its tenant's :class:`SuffixIndex` (module docstring).

    Args:
        max_tokens: the most tokens each tenant's index keeps (``SpeculativeConfig.suffix_max_tokens``).
        scope: "tenant" (an index per tenant) or "global" (one index for every request).
    """

    def __init__(self, max_tokens: int, scope: str = "tenant"):
        self.max_tokens, self.scope = max_tokens, scope
        self.indexes: dict[str | None, SuffixIndex] = {}
        self.running: dict[int, RequestView] = {}  # seq id -> the request, indexed when it finishes

    def _index(self, seq: RequestView) -> SuffixIndex:
        key = None if self.scope == "global" else seq.tenant
        index = self.indexes.get(key)
        if index is None:
            index = self.indexes[key] = SuffixIndex(self.max_tokens)
        return index

    def _continuations(self, seq: RequestView) -> list[list[int]]:
        self.running[seq.seq_id] = seq
        tokens = seq.all_token_ids
        starts, lengths = lookup_matches(seq.token_array, MIN_MATCH, MAX_MATCH, MAX_MATCHES, token_list=tokens)
        own = [(n, s, tokens[s:s + MAX_MATCH]) for s, n in zip(starts.tolist(), lengths.tolist())]
        return rank_matches(own, self._index(seq).matches(tokens))

    def propose(self, seqs: list[RequestView], num_tokens: list[int]) -> DraftProposal:
        drafts = [suffix_chain(self._continuations(seq), k) if k > 0 else [] for seq, k in zip(seqs, num_tokens)]
        return DraftProposal(drafts, None, [True] * len(seqs))

    def propose_tree(self, seqs: list[RequestView], max_depths: list[int], max_nodes: list[int]) -> DraftProposal:
        """Per request a trie of its matches' continuations (depth ``<= max_depths[i]``, ``<= max_nodes[i]``
        drafts); one-hot, no q."""
        check_tree_budgets(len(seqs), max_depths, max_nodes)
        return tree_proposal([suffix_tree(seq.last_token_id, self._continuations(seq), d, n)
                              for seq, d, n in zip(seqs, max_depths, max_nodes)])

    def free(self, seq_id: int, finished: bool) -> None:
        seq = self.running.pop(seq_id, None) if finished else self.running.get(seq_id)
        if finished and seq is not None:
            self._index(seq).add(list(seq.output_token_ids))
