"""Static token trees as the CLI and SpeculativeConfig give them: parsing ``--tree`` and counting a tree's nodes."""

from __future__ import annotations


def tree_size(branching: list[int]) -> int:
    """Drafted nodes of a static tree where every node at depth d has ``branching[d]`` children."""
    total, width = 0, 1
    for b in branching:
        width *= b
        total += width
    return total


def parse_tree(text: str | None) -> list[int] | str | None:
    """A ``--tree`` option: ``"3,2,1,1"`` -> ``[3, 2, 1, 1]``, ``"dynamic"``, or None / ``""`` / ``"none"``."""
    if text is None or text.strip().lower() in ("", "none", "chain"):
        return None
    if text.strip().lower() == "dynamic":
        return "dynamic"
    try:
        return [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"--tree must be 'dynamic' or comma-separated branching factors like 3,2,1,1; got {text!r}"
                         ) from None
