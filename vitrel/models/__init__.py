"""Backbones (global ViT, Swin-style windowed ViT), the model factory and checkpoint loading.

Layers: ``registry`` (architecture table, building; no I/O) <- ``checkpoint`` (reading / writing
weights) <- ``factory`` (``create_model``, timm entry points).
"""

from vitrel.models.checkpoint import CheckpointError, export_model, extract_model_state, load_model, save_pretrained
from vitrel.models.factory import create_model
from vitrel.models.inflate import inflate_image_model
from vitrel.models.irpe_import import from_irpe
from vitrel.models.registry import build_from_cfg, list_models
from vitrel.models.rope_layout import swap_rope_axial_halves
from vitrel.models.swin import SwinTransformer
from vitrel.models.swin3d import SwinTransformer3D
from vitrel.models.timm_import import TransferReport, UnsupportedTimmModel, from_timm, transfer_timm_weights
from vitrel.models.video_vit import VideoVisionTransformer
from vitrel.models.videomae_import import from_videomae
from vitrel.models.vit import VisionTransformer
from vitrel.models.vjepa2_import import from_vjepa2

__all__ = [
    "CheckpointError",
    "SwinTransformer",
    "SwinTransformer3D",
    "VideoVisionTransformer",
    "VisionTransformer",
    "build_from_cfg",
    "from_irpe",
    "from_timm",
    "from_videomae",
    "from_vjepa2",
    "transfer_timm_weights",
    "TransferReport",
    "UnsupportedTimmModel",
    "create_model",
    "inflate_image_model",
    "export_model",
    "extract_model_state",
    "list_models",
    "load_model",
    "save_pretrained",
    "swap_rope_axial_halves",
]
