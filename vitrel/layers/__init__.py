from vitrel.layers.attention import SHARED, Attention
from vitrel.layers.attentive_pool import AttentivePool

__all__ = ["Attention", "AttentivePool", "SHARED"]
