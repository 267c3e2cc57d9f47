"""Lightning's model summary of a run: its FLOPs are those of one forward on one sample of the data's shape
(``ClassifierModule.example_input_array``), checked against a count written from the architecture."""

from __future__ import annotations

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import summarize

from vitrel.models.video_vit import VideoVisionTransformer
from vitrel.models.vit import VisionTransformer
from vitrel.train.module import ClassifierModule

DIM, DEPTH, HEADS, MLP, PATCH, CLASSES = 32, 2, 2, 2.0, 4, 10


def _vit(attn_impl: str) -> VisionTransformer:
    return VisionTransformer(
        img_size=28, patch_size=PATCH, in_chans=1, num_classes=CLASSES, embed_dim=DIM, depth=DEPTH, num_heads=HEADS,
        mlp_ratio=MLP, pos="none", attn_impl=attn_impl, global_pool="avg", dynamic_img_size=True,
    )  # fmt: skip


def analytic_flops(side: int, chans: int = 1) -> tuple[int, int]:
    """(all, attention's) FLOPs of the tiny ViT's forward on one ``side`` x ``side`` image, 2 per multiply-add as
    torch's FlopCounterMode counts them: the patch embedding, per block qkv, the attention's ``q @ k^T`` and
    ``attn @ v``, the projection and the MLP, and the head (no norms, softmax nor bias adds)."""
    grid = side // PATCH
    n = grid * grid + 1  # patch tokens and the class token
    hidden = int(DIM * MLP)
    embed = 2 * grid * grid * DIM * chans * PATCH * PATCH
    attn = 2 * (2 * n * n * DIM)  # q @ k^T and attn @ v over the heads
    block = 2 * n * DIM * (3 * DIM) + attn + 2 * n * DIM * DIM + 2 * (2 * n * DIM * hidden)
    return embed + DEPTH * block + 2 * DIM * CLASSES, DEPTH * attn


class _Seen(ModelSummary):
    """The summary's total FLOPs and the model's input size, as the run's summary printed them."""

    def __init__(self) -> None:
        super().__init__(max_depth=1)
        self.seen: dict = {}

    def summarize(self, summary_data, *args, total_flops: int = 0, **kw) -> None:  # type: ignore[override]
        self.seen = {"flops": total_flops, "in": dict(summary_data).get("In sizes", [None])[0]}


@pytest.mark.parametrize("attn_impl", ["eager", "sdpa"])
def test_run_summary_flops_are_one_sample_of_the_data(attn_impl):
    """A tiny run's summary: the FLOPs of the model at the data's img_size (28), not 0, and not at a side drawn by
    size_choices (the data module leaves the summary's bare example tensor alone). Eager attention: equal to the
    analytic count, and sdpa's CPU kernel too (:mod:`vitrel.train.flops`: torch counts its CUDA kernels only)."""
    from vitrel.data.fashion_mnist import FashionMNISTDataModule

    dm = FashionMNISTDataModule(batch_size=16, num_workers=0, loader="memory", size_choices=[16, 36], seed=3)
    seen = _Seen()
    trainer = L.Trainer(
        max_steps=1, limit_val_batches=0, accelerator="cpu", logger=False, enable_checkpointing=False,
        enable_progress_bar=False, callbacks=[seen],
    )  # fmt: skip
    trainer.fit(ClassifierModule(_vit(attn_impl)), datamodule=dm)
    total, _ = analytic_flops(28)
    assert seen.seen["flops"] == total  # (sdpa on CPU: vitrel.train.flops counts its kernel, torch does not)
    assert seen.seen["in"] == "[1, 1, 28, 28]"


def test_clip_example_and_true_precision():
    """A video data config gives a clip ``[1, C, T, H, W]``; under bf16 weights the example is bf16 too."""
    net = VideoVisionTransformer(
        img_size=16, num_frames=4, patch_size=4, tubelet_size=2, in_chans=1, num_classes=3, embed_dim=16, depth=1,
        num_heads=2, pos="none",
    )  # fmt: skip
    module = ClassifierModule(net, data_config={"input_size": [1, 16, 16], "num_frames": 4})
    module.setup("fit")
    assert module.example_input_array.shape == (1, 1, 4, 16, 16)
    assert summarize(module).total_flops > 0
    module.to(torch.bfloat16)
    assert module.example_input_array.dtype == torch.bfloat16


def test_flex_attention_gets_no_example_and_says_why(caplog):
    """Compiled FlexAttention does not run under torch's FlopCounterMode (a TypeError): a model with
    ``attn_impl="flex"`` gets no example input, so the summary runs without FLOPs, and one line says why."""
    import logging

    from vitrel.train.module import SUMMARY_FLEX

    module = ClassifierModule(_vit("flex"), data_config={"input_size": [1, 28, 28]})
    with caplog.at_level(logging.INFO):
        module.setup("fit")
    assert summarize(module).total_flops == 0  # (with an example: TypeError from flex_attention)
    assert module.example_input_array is None
    assert SUMMARY_FLEX in caplog.text
