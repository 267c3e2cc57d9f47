"""``batch.png`` (``callbacks.batch_preview``): the first training batch as the training step gets it, drawn without
changing what the step draws."""

from __future__ import annotations

import functools
import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from timm.data import Mixup
from timm.data.naflex_mixup import NaFlexMixup

import vitrel
from tests.train_helpers import FAST, TINY_VIDEO, TINY_VIT, compose
from vitrel.data.packing import PackingCollator
from vitrel.train import batch_preview
from vitrel.train.batch_preview import BatchPreview, batch_images
from vitrel.train.module import ClassifierModule
from vitrel.train.run import train

SHORT = ["trainer.max_epochs=1", "trainer.limit_train_batches=2", "trainer.limit_val_batches=1", "test=false"]
SHORT += ["logger=none"]


def _states():
    return torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()


def _same_states(a, b) -> bool:
    return torch.equal(a[0], b[0]) and np.array_equal(a[1], b[1]) and a[2] == b[2]


@pytest.mark.parametrize("kind", ["images", "naflex"])
def test_the_preview_draws_the_steps_mix_and_leaves_the_random_states(kind, tmp_path, monkeypatch):
    """The images drawn are those the module's own mixing gives the step from the same states; after the draw the
    torch, numpy and python states are as before it, and the batch the step gets is untouched (timm's Mixup mixes in
    place)."""
    torch.manual_seed(0)
    model = vitrel.create_model("vitrel_vit_tiny_patch4_32", embed_dim=32, depth=1, num_heads=2, num_classes=5)
    if kind == "images":
        mixer = functools.partial(Mixup, mixup_alpha=0.8, cutmix_alpha=1.0)
        x, y = torch.randn(6, 3, 32, 32), torch.tensor([0, 1, 2, 3, 4, 0])
    else:
        mixer = functools.partial(NaFlexMixup, mixup_alpha=0.8, cutmix_alpha=1.0)
        imgs = [torch.randn(3, 4 * h, 4 * w) for h, w in [(2, 3), (4, 4), (3, 1), (1, 2), (2, 2)]]
        from timm.data.naflex_transforms import Patchify

        x, y = PackingCollator(32)([(Patchify(4)(img), i) for i, img in enumerate(imgs)])
    module = ClassifierModule(model, num_classes=5, mixup=mixer)
    drawn = {}
    monkeypatch.setattr(batch_preview, "draw_batch", lambda images, y, path, **kw: drawn.update(images=images, **kw))
    trainer = SimpleNamespace(is_global_zero=True, datamodule=SimpleNamespace(mean=None, std=None, class_names=None))
    given = x.clone() if kind == "images" else {k: v for k, v in x.items()}
    for seed in range(3):
        torch.manual_seed(seed), np.random.seed(seed), random.seed(seed)
        before = _states()
        BatchPreview(tmp_path).on_train_batch_start(trainer, module, (x, y), 0)
        assert _same_states(before, _states())
        mixed, target = module.mix(x.clone() if kind == "images" else x, y)  # (what the step mixes, from there)
        want = batch_images(mixed, 4)
        assert len(drawn["images"]) == len(want)
        for a, b in zip(drawn["images"], want, strict=True):
            torch.testing.assert_close(a, b, rtol=0, atol=0)
        torch.testing.assert_close(drawn["target"], target, rtol=0, atol=0)
    if kind == "images":
        torch.testing.assert_close(x, given, rtol=0, atol=0)
    else:
        assert all(x[k] is given[k] for k in given)


def test_clips_show_their_frames_side_by_side():
    clips = torch.randn(2, 3, 4, 5, 6)  # [B, C, T, H, W]
    shown = batch_images(clips)
    for b in range(2):
        want = torch.cat([clips[b, :, t] for t in range(4)], dim=-1)  # frame t at columns t*W ... (t+1)*W
        torch.testing.assert_close(shown[b], want, rtol=0, atol=0)


def test_a_bad_count_is_refused():
    with pytest.raises(ValueError, match="images=0"):
        BatchPreview("x", images=0)


@pytest.mark.parametrize(
    "over",
    [
        [*TINY_VIT, "module/mixup=default", "data.drop_last=true"],
        ["experiment=fmnist_naflex", "module/mixup=naflex", "model.embed_dim=32", "model.depth=1", "model.num_heads=2"],
        TINY_VIDEO,
    ],
    ids=["images-mixup", "naflex-mixup", "clips"],
)
def test_train_writes_batch_png_in_the_run_folder(tmp_path, over):
    from PIL import Image

    train(compose(tmp_path, [a for a in [*over, *FAST, *SHORT] if "batch_preview" not in a]))  # (FAST: it off)
    with Image.open(tmp_path / "batch.png") as png:
        assert png.format == "PNG" and min(png.size) > 200


def test_titles_fit_the_figure_and_do_not_run_into_each_other(monkeypatch, tmp_path):
    """A batch of 4 with long class names under Mixup (two lines an image) and a long title: the figure's title was cut
    at both edges and neighbouring images' titles overlapped (an audit's batch.png). Every title lies inside the
    figure, and no two intersect."""
    figures = []
    monkeypatch.setattr(batch_preview, "save_png", lambda fig, path: figures.append(fig))
    names = ["Pushing something from left to right", "n01440764 tench", "goldfish", "great white shark"]
    target = torch.tensor([[0.62, 0.38, 0, 0], [0, 0.7, 0.3, 0], [0.5, 0, 0.5, 0], [0, 0, 0.2, 0.8]])
    title = "the first training batch as the step gets it: 4 of its 4 images, mixed (the target's shares)"
    images = [torch.rand(3, 32, 32) for _ in range(4)]
    batch_preview.draw_batch(images, torch.arange(4), tmp_path / "b.png", target=target, class_names=names, title=title)
    (fig,) = figures
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    renderer = FigureCanvasAgg(fig).get_renderer()
    boxes = [fig._suptitle.get_window_extent(renderer)] + [ax.title.get_window_extent(renderer) for ax in fig.axes]
    whole = fig.bbox
    assert all(b.x0 >= whole.x0 and b.x1 <= whole.x1 and b.y1 <= whole.y1 for b in boxes)
    assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1 :])
