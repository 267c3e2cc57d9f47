"""Which q / k / v biases a timm attention learns, as vitrel's ``qkv_bias`` (``True``, ``False`` or ``"qv"``).

timm's BEiT, EVA and Swin V2 learn a query and a value bias and hold the key's at zero (``q_bias`` and ``v_bias``
parameters, ``k_bias`` a buffer; EVA-02's separate projections: ``k_proj`` without a bias). vitrel builds those
models with ``qkv_bias="qv"``, so that fine-tuning them learns what timm's does: under RoPE, cosine attention or q / k
norms a key bias would be a term of its own."""

from __future__ import annotations

from torch import nn


def qkv_bias_of(attn: nn.Module) -> bool | str:
    """``qkv_bias`` for a vitrel attention learning the biases timm's ``attn`` learns."""
    learned = dict(attn.named_parameters())
    if getattr(attn, "q_bias", None) is not None:  # (timm's fused qkv without a bias, q / k / v biases beside it)
        return True if "k_bias" in learned else "qv"
    if getattr(attn, "qkv", None) is None and getattr(attn, "q_proj", None) is not None:  # (EVA-02's q / k / v)
        q, k, v = (getattr(attn, f"{x}_proj").bias is not None for x in "qkv")
        return {(True, True, True): True, (True, False, True): "qv", (False, False, False): False}[(q, k, v)]
    return attn.qkv.bias is not None
