from vitrel.layers.attention import SHARED, Attention

__all__ = ["Attention", "SHARED"]
