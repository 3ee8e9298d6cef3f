"""Grammars for structured outputs, backed by llguidance: compiled once per constraint, one matcher per request.

Why llguidance (``pip install llguidance``): it is one self-contained wheel (a Rust core, no Python dependencies,
one abi3 build for every Python), it compiles JSON schemas, regexes and Lark grammars, computes a token mask in
tens of microseconds to a few ms, and its matcher rolls back - what speculation needs: a window's rows are masked
by walking the drafts and rolling back to the committed state. vLLM and SGLang ship it as a backend. xgrammar, the
other choice they use, pulls in transformers, pydantic and a TVM runtime.

:class:`GrammarCompiler` belongs to an engine (one tokenizer); :class:`GrammarState` to a request (one sample of it),
advanced by the engine as tokens are committed (``Sequence.append_token``).
"""

from __future__ import annotations

import json
from collections import OrderedDict

import numpy as np

from specdec.structured.params import StructuredOutputsParams

MAX_CACHED_GRAMMARS = 256  # compiled grammar texts kept per engine (LRU)


def _llguidance():
    try:
        import llguidance
    except ImportError:
        raise ValueError("structured outputs need the llguidance package: pip install llguidance") from None
    return llguidance


class GrammarCompiler:
    """Compiles a request's :class:`StructuredOutputsParams` into a grammar for this tokenizer and makes matchers.

    Args:
        tokenizer_json: the model's ``tokenizer.json`` as text (``Tokenizer.to_json``).
        vocab_size: the model's vocabulary (logits' width); ids beyond the tokenizer's are never allowed.
        eos_token_ids: the ids that end a sequence (allowed where the grammar may end); ids beyond both
            vocabularies are left out (a model that never emits its eos id).
        tokenizer_vocab_size: the tokenizer's own size, added tokens included (None: ``vocab_size``).
    """

    def __init__(self, tokenizer_json: str, vocab_size: int, eos_token_ids: list[int],
                 tokenizer_vocab_size: int | None = None):
        self._tokenizer_json = tokenizer_json
        self.vocab_size = vocab_size
        self._table_size = max(vocab_size, tokenizer_vocab_size or 0)  # the grammar's token table
        self.eos_token_ids = sorted(t for t in eos_token_ids if 0 <= t < self._table_size)
        if not self.eos_token_ids:  # llguidance would take token 0 as the eos: a grammar could never emit it
            raise ValueError(f"structured outputs need an eos token id below {self._table_size}; the model's are "
                             f"{sorted(eos_token_ids)}")
        self._tokenizer = None  # llguidance.LLTokenizer, built on first use (~0.5 s for a 49k vocabulary)
        self._grammars: OrderedDict[tuple[str, str], str] = OrderedDict()

    @property
    def tokenizer(self):
        if self._tokenizer is None:
            llg = _llguidance()
            self._tokenizer = llg.LLTokenizer(self._tokenizer_json, n_vocab=self._table_size,
                                              eos_token=self.eos_token_ids)  # fmt: skip
        return self._tokenizer

    def compile(self, params: StructuredOutputsParams) -> str:
        """The grammar of ``params`` (cached per constraint), or ``ValueError`` saying what is wrong with it."""
        key = params.key()
        grammar = self._grammars.get(key)
        if grammar is not None:
            self._grammars.move_to_end(key)
            return grammar
        llg = _llguidance()
        kind = params.kind
        options = {"whitespace_flexible": False} if params.disable_any_whitespace else None
        if kind == "json":
            schema = json.loads(params.json) if isinstance(params.json, str) else params.json
            grammar = llg.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        elif kind == "json_object":
            grammar = llg.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=options)
        elif kind == "regex":
            grammar = llg.LLMatcher.grammar_from_regex(params.regex)
        elif kind == "choice":
            grammar = llg.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in params.choice))
        else:
            grammar = llg.LLMatcher.grammar_from_lark(params.grammar)
        is_error, messages = llg.LLMatcher.validate_grammar_with_warnings(grammar, self.tokenizer)
        if is_error:
            raise ValueError(f"structured_outputs.{kind} is not usable: {messages[0].strip()}")
        self._grammars[key] = grammar
        if len(self._grammars) > MAX_CACHED_GRAMMARS:
            self._grammars.popitem(last=False)
        return grammar

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher at the start of the output (``ValueError`` for a bad constraint)."""
        matcher = _llguidance().LLMatcher(self.tokenizer, self.compile(params), log_level=0)
        if matcher.is_error():
            raise ValueError(f"structured_outputs.{params.kind} is not usable: {matcher.get_error()}")
        return GrammarState(matcher, self.vocab_size, self.eos_token_ids)


class GrammarState:
    """A request's position in its grammar: the tokens it has committed, and what may follow.

    Masks are bool numpy ``[V]`` (True: allowed). Speculation asks for the masks along a draft (each after the
    drafts before it) and the matcher is rolled back afterwards: only :meth:`accept` moves it for good.
    """

    def __init__(self, matcher, vocab_size: int, eos_token_ids: list[int]):
        self._matcher = matcher
        self.vocab_size = vocab_size
        self._eos = frozenset(eos_token_ids)

    @property
    def finished(self) -> bool:
        """The grammar is complete and admits nothing more (a closed JSON value, a matched choice)."""
        return self._matcher.is_stopped()

    def accept(self, token: int) -> None:
        """Commit ``token``; ``ValueError`` if the grammar does not allow it (the request then ends with an error)."""
        if self._matcher.validate_tokens([token]) != 1 or not self._matcher.consume_token(token):
            raise ValueError(f"token {token} is outside the request's grammar: {self._matcher.get_error()}")

    def allowed(self) -> np.ndarray:
        """bool ``[V]``: the tokens allowed next."""
        if self._matcher.is_error():
            raise ValueError(f"the request's grammar is in an error state: {self._matcher.get_error()}")
        bits = np.frombuffer(self._matcher.compute_bitmask(), dtype=np.uint8)
        return np.unpackbits(bits, bitorder="little")[: self.vocab_size].astype(bool)

    def allowed_along(self, drafts: list[int]) -> np.ndarray:
        """bool ``[len(drafts) + 1, V]``: row j the tokens allowed after the first j drafts. Past a draft the grammar
        refuses every token is allowed in the rows after it: that draft's own row masks it, so verification rejects
        it there and never reads the later rows; past an eos draft likewise (if it is accepted the request ends
        there). The matcher is left where it was."""
        out = np.ones((len(drafts) + 1, self.vocab_size), dtype=bool)
        # NOTE: only tokens validated first are consumed: a refused consume puts the matcher in an error state that
        # no rollback leaves
        # NOTE: nor is an eos draft: a matcher that consumed eos is stopped, and rolling it back does not restore it
        valid = next((j for j, t in enumerate(drafts) if t in self._eos), len(drafts))
        valid = self._matcher.validate_tokens(list(drafts[:valid])) if valid else 0
        consumed = 0
        try:
            for j in range(valid + 1):
                out[j] = self.allowed()
                if j == valid:
                    break
                if not self._matcher.consume_token(drafts[j]):
                    raise RuntimeError(f"the grammar refused draft token {drafts[j]} it had validated")
                consumed += 1
        finally:  # the matcher goes back to the committed output, also when a mask fails half way
            if consumed:
                self._matcher.rollback(consumed)
        return out

    def allowed_after(self, drafts: list[int]) -> np.ndarray:
        """bool ``[V]``: the tokens allowed after ``drafts`` (all True if the grammar refuses one of them)."""
        return self.allowed_along(drafts)[len(drafts)] if drafts else self.allowed()

    def valid_prefix(self, tokens: list[int]) -> int:
        """How many of ``tokens`` the grammar accepts in a row from here (the matcher does not move)."""
        return self._matcher.validate_tokens(list(tokens))

    def forced_tokens(self) -> list[int]:
        """The tokens of the text the grammar forces from here (a key, punctuation; [] where it allows a choice)."""
        return list(self._matcher.compute_ff_tokens())
