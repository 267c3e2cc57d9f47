"""Start from the iRPE authors' released DeiT weights: :func:`from_irpe`.

The authors (microsoft/Cream, ``iRPE/DeiT-with-iRPE``, commit 12aed81) release DeiT models with iRPE
(``rpe_models.py``): timm's DeiT (``qkv_bias``, a class token, a learned absolute embedding over the class token and
the patches) whose blocks' attention adds iRPE's terms (``RPEAttention``), saved as ``{"model": state_dict}`` in
``<name>.pth`` at ``github.com/wkcn/iRPE-model-zoo/releases``. The network is the same function in vitrel: the DeiT
part goes through :func:`~vitrel.models.timm_import.from_timm` (its embedding kept as ``abs_pos="ape"``, the class
token's slot folded into the class token), each block's ``attn.rpe_{q,k,v}.*`` tables to its ``attn.pos.rpe_*``
(``pos=irpe`` with the model's options, :data:`RELEASED`).
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import timm
import torch
from torch import Tensor, nn

from vitrel.models.checkpoint import CheckpointError
from vitrel.models.data_config import data_fields, set_data_config
from vitrel.models.registry import split_feature_args, with_features
from vitrel.models.timm_import import from_timm

__all__ = ["MODEL_ZOO", "RELEASED", "from_irpe"]

#: the models the authors define (``rpe_models.py``): their timm DeiT and the ``irpe`` options of their
#: ``get_rpe_config`` (contextual, shared heads, one extra bucket for the class token); weights are released for
#: those in :data:`MODEL_ZOO`, the others load from a file trained with their code
RELEASED: dict[str, tuple[str, dict[str, Any]]] = {
    "deit_tiny_patch16_224_ctx_product_50_shared_k": ("deit_tiny_patch16_224", {"method": "product", "rpe_on": "k"}),
    "deit_small_patch16_224_ctx_euc_20_shared_k": ("deit_small_patch16_224", {"method": "euc", "ratio": 20}),
    "deit_small_patch16_224_ctx_quant_51_shared_k": ("deit_small_patch16_224", {"method": "quant", "ratio": 33}),
    "deit_small_patch16_224_ctx_cross_56_shared_k": ("deit_small_patch16_224", {"method": "cross", "ratio": 20}),
    "deit_small_patch16_224_ctx_product_50_shared_k": ("deit_small_patch16_224", {"method": "product"}),
    "deit_small_patch16_224_ctx_product_50_shared_qk": ("deit_small_patch16_224", {"rpe_on": "qk"}),
    "deit_small_patch16_224_ctx_product_50_shared_qkv": ("deit_small_patch16_224", {"rpe_on": "qkv"}),
    "deit_base_patch16_224_ctx_product_50_shared_k": ("deit_base_patch16_224", {"rpe_on": "k"}),
    "deit_base_patch16_224_ctx_product_50_shared_qkv": ("deit_base_patch16_224", {"rpe_on": "qkv"}),
}
#: the models whose weights the authors release (their README's model zoo, ``_provided_checkpoints``)
MODEL_ZOO = frozenset(n for n in RELEASED if "_ctx_product_50_" in n)
#: a block's iRPE table in the authors' state dict
_TABLE = re.compile(r"blocks\.(\d+)\.attn\.(rpe_[qkv]\..+)")


def _state_dict(path: Path) -> dict[str, Tensor]:
    if not path.is_file():
        raise CheckpointError(f"no such file: {path} (an iRPE model's weights, <name>.pth from the authors' model zoo)")
    ckpt = torch.load(path, map_location="cpu", weights_only=True)
    sd = ckpt.get("model", ckpt) if isinstance(ckpt, dict) else None
    if not isinstance(sd, dict) or not all(isinstance(v, Tensor) for v in sd.values()):
        raise CheckpointError(f"{path} holds no state dict (the authors save {{'model': state_dict}})")
    return sd


def from_irpe(path: str | os.PathLike, name: str | None = None, **kwargs: Any) -> nn.Module:
    """A vitrel ViT with the weights of the iRPE authors' model at ``path`` (the same function): one of their model
    zoo (:data:`MODEL_ZOO`) or another model of their ``rpe_models.py`` (:data:`RELEASED`), trained with their code.

    Args:
        path: the model's ``.pth`` (``{"model": state_dict}``, or the state dict itself).
        name: the model's name (a key of :data:`RELEASED`); default the file's name without ``.pth``.
        **kwargs: as :func:`~vitrel.models.timm_import.from_timm`'s (``num_classes`` resets the head, ``img_size``
            resizes the absolute embedding; iRPE's tables take any grid as they are; ``features_only=True``: timm's
            backbone of the network, :func:`~vitrel.models.registry.with_features`).
    """
    kwargs, feature_args = split_feature_args(kwargs)
    p = Path(path)
    name = name or p.stem
    if name not in RELEASED:
        raise ValueError(f"{name!r} is not one of the iRPE authors' models (rpe_models.py): {', '.join(RELEASED)}")
    deit, options = RELEASED[name]
    sd = _state_dict(p)
    tables = {k: v for k, v in sd.items() if _TABLE.fullmatch(k)}
    if not tables:
        raise CheckpointError(f"{p} holds no iRPE tables (blocks.<i>.attn.rpe_<q|k|v>.*): not an iRPE model")
    dtype = next((v.dtype for v in sd.values() if v.is_floating_point()), torch.float32)
    source = timm.create_model(deit, pretrained=False).to(dtype)  # (the file's precision: folds made in it)
    try:
        source.load_state_dict({k: v for k, v in sd.items() if k not in tables}, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"{p} does not fit {name} (timm's {deit} with iRPE): {e}") from None
    pos = {"name": "irpe", **options}
    ours = from_timm(source, pos, abs_pos="ape", **kwargs)
    want = {f"blocks.{m[1]}.attn.pos.{m[2]}": v for k, v in tables.items() if (m := _TABLE.fullmatch(k))}
    have = {k: v for k, v in ours.named_parameters() if ".attn.pos." in k}
    if set(want) != set(have) or any(want[k].shape != have[k].shape for k in want):
        shapes = sorted((k, tuple(v.shape)) for k, v in want.items())[:3]
        raise CheckpointError(f"{p}: its iRPE tables ({shapes}, ...) are not those of {name} (pos={pos})")
    with torch.no_grad():
        for k, v in want.items():
            have[k].copy_(v)
    # DeiT's evaluation, which the authors' code keeps: resize to 256 / 224 of the input, centre crop (timm's cfg: 0.9)
    set_data_config(ours, {**data_fields(ours.pretrained_cfg), "crop_pct": 224 / 256})
    return with_features(ours, feature_args)
