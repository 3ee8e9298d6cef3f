"""Structured outputs: a request's output constrained to a JSON schema, a regex, a choice or a grammar.

``params.py`` (what a request asks), ``grammar.py`` (llguidance: grammars compiled per constraint, a matcher per
request), ``masking.py`` (the mask on logits rows), ``step_masks.py`` (which rows of a step get which mask)."""

from specdec.structured.params import StructuredOutputsParams

__all__ = ["StructuredOutputsParams"]
