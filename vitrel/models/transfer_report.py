"""What :func:`~vitrel.models.timm_import.from_timm` did with every tensor of the timm source: :class:`TransferReport`,
logged in full, and :meth:`TransferReport.lost_position`, the trained position parameters another scheme leaves
behind, which ``from_timm`` names in a warning."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["BUFFER", "CANCELLED", "TransferReport"]

#: the reason a dropped index or mask buffer gives (vitrel computes its own for any grid: nothing trained is lost)
BUFFER = "index / mask buffer (vitrel computes it for any grid)"
#: the reason a dropped ConViT positional bias gives (the softmax over the keys cancels it: the same function)
CANCELLED = "GPSA's positional bias: one value per head and query, which the softmax over keys cancels"


@dataclass
class TransferReport:
    """What happened to every tensor: ``carried`` (same key and shape), ``converted`` (renamed or
    reshaped: ``ours <- theirs``), ``initialised`` (ours, freshly initialised: position parts of another
    scheme, a new head), ``dropped`` (theirs, not used, with the reason)."""

    carried: list[str] = field(default_factory=list)
    converted: dict[str, str] = field(default_factory=dict)
    initialised: list[str] = field(default_factory=list)
    dropped: dict[str, str] = field(default_factory=dict)

    def summary(self) -> str:
        lines = [
            f"carried {len(self.carried)} tensors, converted {len(self.converted)}, "
            f"newly initialised {len(self.initialised)}, dropped {len(self.dropped)}"
        ]
        lines += [f"  converted  {k} <- {v}" for k, v in self.converted.items()]
        lines += [f"  new        {k}" for k in self.initialised]
        lines += [f"  dropped    {k}: {why}" for k, why in self.dropped.items()]
        return "\n".join(lines)

    def lost_position(self) -> list[str]:
        """The dropped tensors that held trained values (the source's position parameters a target of another
        scheme has no place for), less the buffers and the terms the function does not depend on."""
        return [k for k, why in self.dropped.items() if why not in (BUFFER, CANCELLED)]

    def lost_position_warning(self, source: str, pos: str) -> str | None:
        """One warning naming :meth:`lost_position`'s tensors by kind (``pos_embed``, ``relative_position_bias_table
        (x12)``), how to keep a ViT's absolute embedding, and where the full list is; None when nothing was lost."""
        lost = self.lost_position()
        if not lost:
            return None
        kinds: dict[str, int] = {}
        for k in lost:
            tail = k.split("[")[0].rsplit(".", 1)[-1]
            kinds[tail] = kinds.get(tail, 0) + 1
        named = ", ".join(f"{t} (x{n})" if n > 1 else t for t, n in kinds.items())
        keep = " (abs_pos='ape' keeps the absolute embedding; train.py: +model.abs_pos=ape)"
        keep = keep if "pos_embed" in kinds else ""
        return (
            f"from_timm({source}) -> pos={pos}: the source's trained position parameters are not carried: "
            f"{named}{keep}; the scheme's own start fresh (the transfer report, logged, lists each tensor)"
        )
