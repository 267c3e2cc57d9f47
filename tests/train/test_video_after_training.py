"""What a user runs after training, on video: a video model started from an image checkpoint that train.py wrote
(inflation), then fine-tuned by train.py (model=from_checkpoint)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch

import vitrel
from tests.train_helpers import FAST, TINY_VIT, compose
from vitrel.models.data_config import stored_data_config
from vitrel.models.inflate import inflate_image_model
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1"]
SHORT += ["trainer.limit_test_batches=1", "logger=none"]


@pytest.fixture(scope="module")
def image_run(tmp_path_factory):
    """``python train.py model=vit_tiny_fmnist +model.class_token=false pos=rel2d_full module/ema=default`` (tiny, two
    steps): its ``last.ckpt``, whose tested weights are the EMA copy."""
    out = tmp_path_factory.mktemp("image_run")
    over = [*TINY_VIT, "+model.class_token=false", "pos=rel2d_full", "module/ema=default", *FAST, *SHORT]
    train(compose(out, over))
    return out / "checkpoints" / "last.ckpt"


def _video_of(image_cfg: dict) -> torch.nn.Module:
    """The video ViT matching the image run's model (widths, patches, 28-px frames), ``rel3d_full``."""
    keys = ("embed_dim", "depth", "num_heads", "mlp_ratio", "patch_size", "img_size", "in_chans", "num_classes")
    args = {k: image_cfg[k] for k in keys}
    return vitrel.create_model("vitrel_vit_video_tiny_patch4_32", pos="rel3d_full", num_frames=4, **args)


@pytest.mark.parametrize("source", ["checkpoint", "model"])
def test_an_inflated_model_keeps_the_image_runs_preprocessing(image_run, source):
    """The image run normalised Fashion-MNIST with its own mean and std: the inflated video model carries them (and
    the class names, with the head) in ``pretrained_cfg``, as ``vitrel.load_model`` of the checkpoint does, so that a
    fine-tune or ``predict.py`` normalises frames as the image model saw them, not with the architecture's 0.5 / 0.5.
    On a clip of identical frames the inflated model then gives the image model's logits (float64): from the checkpoint
    too, whose weights are read as ``vitrel.load_model``, ``eval.py`` and ``predict.py`` read them, the EMA copy the run
    tested (not the raw weights, which differ from it)."""
    image = vitrel.load_model(image_run).eval()
    stored = stored_data_config(image_run)
    vid = inflate_image_model(image_run if source == "checkpoint" else image, _video_of(image.vitrel_cfg))
    assert image.pretrained_cfg["mean"] == pytest.approx(stored["mean"]) and stored["mean"] != [0.5]
    for key in ("mean", "std", "interpolation", "crop_pct", "crop_mode"):
        assert vid.pretrained_cfg[key] == image.pretrained_cfg[key], key
    assert list(vid.pretrained_cfg["label_names"]) == stored["class_names"]
    assert vid.pretrained_cfg["input_size"] == (1, 28, 28) and vid.pretrained_cfg["num_frames"] == 4
    frame = torch.rand(2, 1, 28, 28, dtype=torch.float64)
    with torch.no_grad():
        clip = frame[:, :, None].expand(-1, -1, 4, -1, -1)
        torch.testing.assert_close(vid.double().eval()(clip), image.double()(frame), rtol=1e-10, atol=1e-10)
    fresh = inflate_image_model(image_run, _video_of(image.vitrel_cfg), head=False)  # another label set: no names
    assert "label_names" not in fresh.pretrained_cfg and fresh.pretrained_cfg["mean"] == image.pretrained_cfg["mean"]


# ------------------------------------------------------------------ more frames than trained: eval.py's rebuild
def _naive_attention(attn, x: torch.Tensor, coords: torch.Tensor, pos: str, table=None) -> torch.Tensor:
    """One attention layer in float64 from the equations, one token pair at a time for the position term:
    ``rel3d_full`` (``extend: clip``): ``+ table[clamp(dt) + T-1, dh + H-1, dw + W-1, head]``; ``rope3d_axial``
    (default sections, ``scaling: linear, factor: auto`` from 4 to 8 frames): pair ``j`` of axis ``a`` (two pairs an
    axis) turned by ``x_a * base^(-k/2) / s_a``, ``s_t = 2``, ``s_h = s_w = 1``."""
    b, n, c = x.shape
    heads, d = attn.num_heads, attn.head_dim
    q, k, v = (x @ attn.qkv.weight.t() + attn.qkv.bias).reshape(b, n, 3, heads, d).permute(2, 0, 3, 1, 4)
    logits = torch.zeros(b, heads, n, n, dtype=torch.float64)
    if pos == "rope3d_axial":

        def turn(t: torch.Tensor) -> torch.Tensor:
            out = t.clone()
            for i in range(n):
                for j in range(d // 2):
                    axis, kk = j // 2, j % 2
                    theta = float(coords[i, axis]) * 10000.0 ** (-kk / 2) / (2.0 if axis == 0 else 1.0)
                    c_, s_ = math.cos(theta), math.sin(theta)
                    out[..., i, 2 * j] = t[..., i, 2 * j] * c_ - t[..., i, 2 * j + 1] * s_
                    out[..., i, 2 * j + 1] = t[..., i, 2 * j] * s_ + t[..., i, 2 * j + 1] * c_
            return out

        q, k = turn(q), turn(k)
    for i in range(n):
        for j in range(n):
            logits[:, :, i, j] = (q[:, :, i] * k[:, :, j]).sum(-1) / math.sqrt(d)
            if pos == "rel3d_full":
                half = [(s - 1) // 2 for s in table.shape[:3]]
                idx = [max(-h, min(h, int(coords[i, a] - coords[j, a]))) + h for a, h in enumerate(half)]
                logits[:, :, i, j] += table[idx[0], idx[1], idx[2], :]
    out = (logits.softmax(-1) @ v).transpose(1, 2).reshape(b, n, c)
    return out @ attn.proj.weight.t() + attn.proj.bias


@pytest.mark.parametrize(
    "pos",
    [
        {"name": "rel3d_full", "extend": "clip", "init_std": 1.0},
        {"name": "rope3d_axial", "scaling": {"rope_type": "linear", "factor": "auto"}},
    ],
    ids=["rel3d_full-clip", "rope3d_axial-linear-auto"],
)
def test_twice_the_frames_through_eval_pys_rebuild_match_the_equations(tmp_path, pos):
    """``eval.py data.num_frames=8`` on a model trained at 4 frames rebuilds it for 8 (``load_model(...,
    num_frames=8)``, learned tables resized on load): its attention over the 8 x 2 x 2 tubelets equals a float64
    reference written from the scheme's definition with the trained weights (a table clipped at the trained offsets;
    RoPE's time frequencies halved by linear scaling from the trained 4 frames), and the 4-frame model run as it is."""
    torch.manual_seed(0)
    args = dict(pos=pos, embed_dim=24, depth=1, num_heads=2, patch_size=16, num_frames=4)
    trained = vitrel.create_model("vitrel_vit_video_tiny_patch4_32", **args).double().eval()
    folder = vitrel.models.save_pretrained(trained, tmp_path / "run")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (the table's resize on load is announced)
        rebuilt = vitrel.load_model(folder, num_frames=8).double().eval()
    seen = {}
    rebuilt.blocks[0].attn.register_forward_hook(lambda m, a, out: seen.update(x=a[0], out=out))
    clip = torch.randn(2, 1, 8, 32, 32, dtype=torch.float64)
    with torch.no_grad():
        logits = rebuilt(clip)
        torch.testing.assert_close(logits, trained(clip), rtol=1e-12, atol=1e-12)
        t, h, w = torch.meshgrid(torch.arange(8), torch.arange(2), torch.arange(2), indexing="ij")
        coords = torch.stack([t.reshape(-1), h.reshape(-1), w.reshape(-1)], 1)
        table = trained.blocks[0].attn.pos.table_4d().double() if pos["name"] == "rel3d_full" else None
        ref = _naive_attention(rebuilt.blocks[0].attn, seen["x"], coords, pos["name"], table)
    torch.testing.assert_close(seen["out"], ref, rtol=1e-10, atol=1e-10)
