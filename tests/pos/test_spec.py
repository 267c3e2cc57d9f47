"""A ``pos=`` value is parsed once (``parse_pos``), in the model, which builds its schemes from the spec and hands
the blocks built modules with their per-layer arguments; forward hooks take the prepared state alone."""

from __future__ import annotations

import pytest
import torch
from omegaconf import OmegaConf

import vitrel.pos.registry as registry
from vitrel import Attention
from vitrel.layout.geometry import Grid
from vitrel.models.swin import SwinTransformer
from vitrel.models.vit import VisionTransformer
from vitrel.pos import PosSpec, parse_pos
from vitrel.pos.registry import UnknownSchemeError, split_pos


def test_parse_pos_forms_and_errors():
    s = parse_pos("rel2d_full")
    assert isinstance(s, PosSpec) and s.name == "rel2d_full" and s.kind == "relative" and s.plain == "rel2d_full"
    cfg = OmegaConf.create({"name": "rope2d_mixed", "base": 100.0, "coords": "index"})
    d = parse_pos(cfg)
    assert d.options == {"base": 100.0, "coords": "index"} and d.plain == {"name": "rope2d_mixed", **d.options}
    assert type(d.plain) is dict  # JSON-able: a model stores it
    assert parse_pos(None) is None and parse_pos(d) is d  # a spec is not parsed again
    with pytest.raises(UnknownSchemeError, match="rel2d_fulll"):
        parse_pos("rel2d_fulll")
    with pytest.raises(ValueError, match=r"no option\(s\) \['_target_'\].*its options"):
        parse_pos({"name": "rel2d_full", "_target_": "x"})  # no pos config has one: refused, not stripped
    with pytest.raises(ValueError, match="'name' key"):
        parse_pos({"base": 1.0})
    with pytest.raises(TypeError, match="not a module"):
        parse_pos(d.build(num_heads=2, head_dim=8, grid=(3, 3)))
    rel, absolute = split_pos(parse_pos("ape"), None)
    assert rel.name == "none" and absolute.name == "ape"
    with pytest.raises(ValueError, match="abs_pos must be an absolute scheme"):
        split_pos(parse_pos("rel2d_full"), parse_pos("rope2d_axial"))


@pytest.mark.parametrize("arch", ["vit", "swin"])
def test_a_model_looks_the_scheme_up_once(arch, monkeypatch):
    calls = []
    real = registry.get_pos_class
    monkeypatch.setattr(registry, "get_pos_class", lambda name: calls.append(name) or real(name))
    if arch == "vit":
        m = VisionTransformer(img_size=16, patch_size=4, embed_dim=32, depth=4, num_heads=2, pos="lookhere")
        schemes = [blk.attn.pos for blk in m.blocks]
        assert [s.layer for s in schemes] == [(i, 4) for i in range(4)]  # per-layer arguments, passed explicitly
    else:
        m = SwinTransformer(
            img_size=16, patch_size=2, embed_dim=16, depths=(2, 2), num_heads=(2, 2), window_size=4, pos="lookhere"
        )
        schemes = [blk.attn.pos for stage in m.layers for blk in stage.blocks]
        assert [s.layer for s in schemes] == [(i, 4) for i in range(4)]
    assert calls == ["lookhere"]
    assert m.vitrel_cfg["pos"] == "lookhere"
    m(torch.randn(1, 3, 16, 16))


def test_hooks_take_the_state_and_attention_takes_a_grid_or_a_state():
    a = Attention(16, 2, pos="rope2d_axial", grid=(3, 3), num_prefix_tokens=1).double()
    x = torch.randn(2, 10, 16, dtype=torch.float64)
    st = a.pos.prepare(Grid(3, 3), 1, x.device, x.dtype)
    assert st.grid == Grid(3, 3) and st.num_prefix_tokens == 1
    torch.testing.assert_close(a(x, (3, 3)), a(x, pos_state=st))
    with pytest.raises(ValueError, match="not both"):
        a(x, (3, 3), pos_state=st)
    with pytest.raises(ValueError, match="needs 9 tokens, but the input has 10"):  # the state decides
        a(x, pos_state=a.pos.prepare(Grid(3, 3), 0, x.device, x.dtype))
    torch.testing.assert_close(a(x), a(x, (3, 3)))  # no grid: the layer's own, as timm's Block calls its attn
    with pytest.raises(ValueError, match=r"built for grid 3x3.*pass the tokens' grid"):
        a(x[:, :5])
