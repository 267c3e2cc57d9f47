"""vitrel's ``features_only`` wrapper: timm's ``FeatureGetterNet`` with what timm's clients call on a backbone.

``timm.create_model(name, features_only=True)`` wraps the network in :class:`FeatureGetter` (the clip models in its
subclass ``ClipFeatureGetterNet``): ``forward(x)`` is ``model.forward_intermediates(x, indices=out_indices, ...)``
as in timm's getter, and besides

* ``set_grad_checkpointing(enable)`` checkpoints the network's blocks (timm's getter has none);
* ``load_state_dict`` takes the weights of the whole network: what ``timm.create_model(name, features_only=True,
  checkpoint_path=...)`` hands it (a training checkpoint's ``model.*`` state dict, an export's
  ``model.safetensors``, a plain state dict), as well as a wrapper's own state dict. The weights of what the wrapper
  pruned (the blocks after the last of ``out_indices``, the final norm, the head) are left out; anything else that
  does not fit is the network's ``CheckpointError``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from timm.models._features import FeatureGetterNet, OutIndicesT
from torch import nn

from vitrel.models.ckpt_files import clean_state_dict

__all__ = ["FeatureGetter"]


class FeatureGetter(FeatureGetterNet):
    """timm's ``FeatureGetterNet`` (arguments and ``forward`` unchanged) with ``set_grad_checkpointing`` and a
    ``load_state_dict`` that takes the unpruned network's weights (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        out_indices: OutIndicesT = 4,
        out_map: Sequence[int | str] | None = None,
        return_dict: bool = False,
        output_fmt: str = "NCHW",
        norm: bool = False,
        prune: bool = True,
    ) -> None:
        full = set(model.state_dict())  # (names only: the tensors are not copied)
        super().__init__(model, out_indices, out_map, return_dict, output_fmt, norm, prune)
        #: the network's weights the wrapper pruned away: a state dict of the whole network may hold them
        self.pruned_keys = frozenset(full - set(self.model.state_dict()))

    @torch.jit.ignore
    def set_grad_checkpointing(self, enable: bool = True) -> None:
        """Checkpoint the network's blocks (recomputed in the backward pass) while gradients are enabled."""
        self.model.set_grad_checkpointing(enable)

    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """The wrapper's own state dict (``model.*``), a training checkpoint's (the network under ``model.*``) or
        the network's (an export, a plain state dict): the weights the wrapper kept load into the network (through
        its ``load_state_dict``: a ``CheckpointError`` for weights that do not fit), those it pruned are dropped.
        Returns the network's missing / unexpected keys under the wrapper's names (``model.*``)."""
        sd = {k: v for k, v in clean_state_dict(state_dict).items() if k not in self.pruned_keys}
        result = self.model.load_state_dict(sd, strict=strict, assign=assign)
        return type(result)([f"model.{k}" for k in result.missing_keys], [f"model.{k}" for k in result.unexpected_keys])
