"""module.compile and NaFlex batches: those run the eager network, with one warning; image batches (token dropping
included) stay compiled. Compiled, a NaFlex batch recompiled at every new layout (each image's grid is Python data the
graph specialises on) until torch's recompile_limit made it eager unsaid."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch
from PIL import Image

import vitrel
from vitrel.data.packing import PackingCollator, naflex_transform
from vitrel.train.module import COMPILE_LAYOUT, ClassifierModule

SIZES = [(28, 28), (20, 32), (32, 16), (12, 24)]


def naflex_batch(sizes: list[tuple[int, int]]) -> tuple[dict, torch.Tensor]:
    rng = np.random.default_rng(0)
    tf = naflex_transform(train=False, patch_size=4, max_tokens=64, mean=(0.5,) * 3, std=(0.5,) * 3)
    items = [
        (tf(Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))), i) for i, (h, w) in enumerate(sizes)
    ]
    return PackingCollator(128, "pack")(items)


class CountingBackend:
    """A torch.compile backend that counts the graphs it is given and runs them as traced."""

    def __init__(self) -> None:
        self.graphs = 0

    def __call__(self, gm: torch.fx.GraphModule, example_inputs: list) -> object:
        self.graphs += 1
        return gm.forward


def module(compile: object, token_drop: float = 0.0) -> ClassifierModule:
    torch.manual_seed(0)
    net = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32",
        pos="rope2d_mixed",
        num_classes=10,
        embed_dim=32,
        depth=2,
        num_heads=2,
        token_drop=token_drop,
    )
    return ClassifierModule(net, compile=compile)


def step(m: ClassifierModule, batch: tuple) -> tuple[torch.Tensor, list[str]]:
    """The training step's loss and the COMPILE_LAYOUT warnings it gave."""
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        loss = m.training_step(batch, 0)
    return loss.detach(), [str(w.message) for w in seen if str(w.message) == COMPILE_LAYOUT]


def test_naflex_batches_under_compile_run_eager_once_warned():
    torch._dynamo.reset()
    backend = CountingBackend()
    compiled, eager = module({"backend": backend}), module(False)
    losses, said = [], []
    for sizes in (SIZES, SIZES[1:], SIZES[:2]):  # three layouts
        batch = naflex_batch(sizes)
        loss, warned = step(compiled, batch)
        said += warned
        torch.testing.assert_close(loss, step(eager, batch)[0], rtol=0, atol=0)
        losses.append(loss)
    assert backend.graphs == 0, f"{backend.graphs} graphs compiled for NaFlex batches"
    assert len(said) == 1, f"the warning came {len(said)} times"


def test_token_drop_under_compile_stays_compiled():
    """Token dropping at a fixed rate keeps one layout per batch shape: compiled once, no warning."""
    torch._dynamo.reset()
    backend = CountingBackend()
    m = module({"backend": backend}, token_drop=0.25)
    x, y = torch.randn(4, 3, 32, 32), torch.arange(4)
    assert not step(m, (x, y))[1] and backend.graphs > 0
    graphs = backend.graphs
    assert not step(m, (torch.randn(4, 3, 32, 32), y))[1] and backend.graphs == graphs


def test_naflex_batches_without_compile_say_nothing():
    assert not step(module(False), naflex_batch(SIZES))[1]


@pytest.mark.parametrize("compile", [False, "counting"])
def test_image_batches_stay_compiled_without_warning(compile):
    torch._dynamo.reset()
    backend = CountingBackend()
    m = module({"backend": backend} if compile else False)
    loss, warned = step(m, (torch.randn(4, 3, 32, 32), torch.arange(4)))
    assert torch.isfinite(loss) and not warned
    assert backend.graphs == (1 if compile else 0)
