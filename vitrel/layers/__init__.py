from vitrel.layers.attention import Attention, attention_logits

__all__ = ["Attention", "attention_logits"]
