"""timm's ``features_only`` getter for clip models (:class:`~vitrel.models.VideoVisionTransformer`,
:class:`~vitrel.models.SwinTransformer3D`).

timm's ``FeatureGetterNet`` hands ``model.forward_intermediates`` its ``output_fmt`` as a ``timm.layers.Format``,
which names image layouts only (``NCHW``, ``NHWC``, ``NCL``, ``NLC``). :class:`ClipFeatureGetterNet` is vitrel's
getter (:class:`~vitrel.models.features.FeatureGetter`: pruning, ``feature_info``, ``norm``, weights and gradient
checkpointing unchanged) with the clip layouts ``NCTHW`` (default) and ``NTHWC`` instead.
"""

from __future__ import annotations

from collections.abc import Sequence

from timm.models._features import OutIndicesT
from torch import nn

from vitrel.models.features import FeatureGetter

__all__ = ["ClipFeatureGetterNet", "CLIP_GETTER_ONLY"]

#: Why timm's other ``features_only`` wrappers do not take a clip model.
CLIP_GETTER_ONLY = (
    "timm's hook / fx / list / dict wrappers hand on the blocks' or stages' outputs under an image layout "
    "(timm.layers.Format: NCHW, NHWC, NCL, NLC)"
)


class ClipFeatureGetterNet(FeatureGetter):
    """vitrel's ``FeatureGetter`` (timm's ``FeatureGetterNet``) for clips ``[B, C, T, H, W]``: ``forward(x)`` is
    ``model.forward_intermediates(x, indices=out_indices, norm=norm, output_fmt=output_fmt, intermediates_only=True)``,
    a list of maps ``[B, C, T', H', W']`` (``output_fmt="NCTHW"``) or ``[B, T', H', W', C]`` (``"NTHWC"``)."""

    output_fmts = ("NCTHW", "NTHWC")

    @classmethod
    def check_output_fmt(cls, output_fmt: str) -> str:
        """``output_fmt`` if this getter gives it, else a ``ValueError``."""
        if output_fmt not in cls.output_fmts:
            raise ValueError(
                f"output_fmt must be 'NCTHW' (channels first, the default) or 'NTHWC' for a clip model's features, "
                f"got {output_fmt!r}"
            )
        return output_fmt

    def __init__(
        self,
        model: nn.Module,
        out_indices: OutIndicesT = 4,
        out_map: Sequence[int | str] | None = None,
        return_dict: bool = False,
        output_fmt: str = "NCTHW",
        norm: bool = False,
        prune: bool = True,
    ) -> None:
        self.check_output_fmt(output_fmt)  # (before timm's getter prunes the model)
        super().__init__(model, out_indices, out_map, return_dict, "NCHW", norm, prune)  # (timm's Format: replaced)
        self.output_fmt = output_fmt
