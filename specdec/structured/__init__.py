"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a grammar.

``params.py`` (what a request asks), ``grammar.py`` (llguidance: grammars compiled per constraint, a matcher per
request), ``masking.py`` (the mask on logits rows). Where the layers use them: ``engine/grammar_masks.py`` (which
rows of a step get which mask), ``spec_decode/forced_drafts.py`` (model-free chains fitted to the grammar, forced
text drafted), ``spec_decode/proposers/chain_drafting.py`` (a model drafter's q masked)."""

from specdec.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
