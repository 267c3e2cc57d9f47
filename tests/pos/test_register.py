"""A scheme registered from outside the package (``vitrel.pos.register_pos``): what its class must declare, and that
the registry refuses a class whose hooks and declarations disagree (the kernels read the declarations)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import vitrel.pos.registry as registry
from vitrel.layout.geometry import pad_prefix, rel_offsets
from vitrel.pos import PositionScheme, list_pos, register_pos


@pytest.fixture
def unregister():
    """Names registered by a test are removed after it (the registry is global: other tests list every scheme)."""
    before = set(registry._REGISTRY)
    yield
    for name in set(registry._REGISTRY) - before:
        del registry._REGISTRY[name]


def _distance_bias(width_attr: str = "width"):
    def bias(self, grid, num_prefix_tokens=0):
        w = getattr(self, width_attr)
        dh, dw = rel_offsets(self.check_grid(grid), w.device)
        return pad_prefix(-w[:, None, None] * (dh**2 + dw**2).to(w.dtype)[None], num_prefix_tokens)

    return bias


@pytest.mark.parametrize(
    ("hook", "flag"),
    [
        ("bias", "has_bias"),
        ("offset_table", "has_offset_table"),
        ("bias_factors", "has_bias_factors"),
        ("rotation", "has_rotation"),
        ("rotate", "has_rotation"),
        ("content_logits", "has_content_terms"),
        ("content_values", "has_content_terms"),
        ("augment", "has_token_terms"),
    ],
)
def test_a_hook_without_its_declaration_is_refused(hook, flag, unregister):
    # a bias() without has_bias = True ran under sdpa but was dropped, silently, by flex, triton and packed batches
    cls = type("Mine", (PositionScheme,), {hook: lambda self, *a, **k: None})
    with pytest.raises(TypeError, match=rf"Mine defines {hook}\(\) but declares {flag} = False: set {flag} = True"):
        register_pos("mine")(cls)
    assert "mine" not in list_pos()


@pytest.mark.parametrize("flag", ["has_bias", "has_offset_table", "has_bias_factors", "has_rotation"])
def test_a_declaration_without_its_hook_is_refused(flag, unregister):
    cls = type("Mine", (PositionScheme,), {flag: True})
    with pytest.raises(TypeError, match=rf"Mine declares {flag} = True but defines no"):
        register_pos("mine")(cls)


def test_add_to_tokens_is_for_absolute_schemes(unregister):
    cls = type("Mine", (PositionScheme,), {"add_to_tokens": lambda self, x, grid, p=0: x})
    with pytest.raises(TypeError, match="kind = 'absolute'"):
        register_pos("mine")(cls)


def test_a_declared_bias_scheme_registers_and_builds(unregister):
    @register_pos("mine")
    class Mine(PositionScheme):
        family = "learned bias"
        has_bias = True
        bias = _distance_bias()

        def __init__(self, *, init_width: float = 0.1, **kw) -> None:
            super().__init__(**kw)
            self.width = nn.Parameter(torch.full((self.num_heads,), float(init_width)))

    assert "mine" in list_pos("relative")
    s = registry.build_pos({"name": "mine", "init_width": 0.5}, num_heads=2, head_dim=8, grid=(3, 3))
    assert torch.equal(s.width, torch.full((2,), 0.5))
