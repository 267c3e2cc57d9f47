"""module.compile with data.size_choices: a static graph per size. torch's automatic dynamic shapes (dynamic=None)
recompiled the second size with symbolic sizes, which for a tiny Swin did not finish in 5 minutes (each static size:
seconds)."""

from __future__ import annotations

import warnings

import torch

import vitrel
from tests.train.test_compile_layout import CountingBackend
from vitrel.train.module import ClassifierModule

CHOICES = [24, 28, 32]


def module(compile: object, choices: list[int] | None = CHOICES) -> ClassifierModule:
    torch.manual_seed(0)
    net = vitrel.create_model(
        "vitrel_vit_tiny_patch4_32", pos="rel2d_full", num_classes=10, embed_dim=32, depth=1, num_heads=2
    )
    data_config = None if choices is None else {"size_choices": choices}
    return ClassifierModule(net, compile=compile, data_config=data_config)


def test_size_choices_compile_a_static_graph_per_size():
    torch._dynamo.reset()
    backend = CountingBackend()
    m = module({"backend": backend})
    y = torch.arange(2)
    for side in (32, 28, 24, 28):
        m.training_step((torch.randn(2, 3, side, side), y), 0)
    assert backend.graphs == len(CHOICES), f"{backend.graphs} graphs for {len(CHOICES)} sizes"
    assert m.compile_kwargs() == {"backend": backend, "dynamic": False}


def test_compile_kwargs_keep_the_users_dynamic_and_the_default_without_choices():
    backend = CountingBackend()
    assert module({"backend": backend, "dynamic": None}).compile_kwargs() == {"backend": backend, "dynamic": None}
    assert module({"backend": backend}, choices=None).compile_kwargs() == {"backend": backend}
    assert module(True, choices=None).compile_kwargs() == {}


def test_more_sizes_than_the_recompile_limit_warn_once():
    m = module({"backend": CountingBackend()})
    with torch._dynamo.config.patch(recompile_limit=3), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert m.step_model is m.step_model  # built once
    said = [str(w.message) for w in seen if "recompile_limit=3" in str(w.message)]
    assert len(said) == 1 and "data.size_choices=[24, 28, 32]" in said[0], said
    with torch._dynamo.config.patch(recompile_limit=4), warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert module({"backend": CountingBackend()}).step_model is not None
    assert not [w for w in seen if "recompile_limit" in str(w.message)]
