"""Position specs as the test matrices build them."""

from __future__ import annotations

from typing import Any

from vitrel.pos.registry import get_pos_class, scheme_options


def for_swin(pos: Any) -> Any:
    """``pos`` as a Swin takes it: a scheme placed after a block (CPE's ``after_block``, 0 by default) at the input,
    the one place the Swin adds an absolute scheme (it refuses another); any other spec as it is."""
    if isinstance(pos, str) and "after_block" in scheme_options(get_pos_class(pos)):
        return {"name": pos, "after_block": None}
    return pos
