"""A contributor's path through docs/schemes.md's "Adding a position scheme": a toy bias scheme and a toy rotary scheme,
written as the section says, reach the registry, the study's selection, the kernels (run or refused by name) and a
training step; the section's import line works inside the package too."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

import vitrel
import vitrel.pos.registry as registry
from tests.train_helpers import FAST, ROOT, TINY_VIT, compose, script_env
from vitrel.layers import Attention
from vitrel.layout.geometry import patch_coords
from vitrel.pos import PositionScheme, register_pos


def _angles(self, grid, num_prefix_tokens, device, dtype):
    """Angles ``(row + 2 col) f_t`` per token and pair, prefix tokens unrotated: ``(cos, sin) [N, d/2]``."""
    r, c = patch_coords(self.check_grid(grid), device)
    f = 0.7 ** torch.arange(self.head_dim // 2, device=device, dtype=torch.float64)
    th = torch.nn.functional.pad((r + 2 * c).double()[:, None] * f, (0, 0, num_prefix_tokens, 0))
    return th.cos(), th.sin()


def _halves(self, q, k, state):
    """The pairs ``(x_t, x_t+d/2)`` turned (GPT-NeoX's layout), not the interleaved ``(x_2t, x_2t+1)``."""
    cos, sin = (t.to(q.dtype) for t in state.rope)

    def turn(x):
        a, b = x.chunk(2, -1)
        return torch.cat([a * cos - b * sin, a * sin + b * cos], -1)

    return turn(q), turn(k)


def _attend(pos, impl, x, grid=(3, 4)):
    torch.manual_seed(0)
    attn = Attention(16, 2, pos=pos, grid=grid, num_prefix_tokens=1, attn_impl=impl).eval()
    with torch.no_grad():
        attn.qkv.weight.normal_(0.0, 1.0)  # logits of order 1: a wrong rotation shows
        return attn(x, grid)


def _naive_rope(x, cos, sin):
    """Interleaved pairs turned, written out in float64."""
    out = x.double().clone()
    for t in range(x.shape[-1] // 2):
        a, b = x[..., 2 * t].double(), x[..., 2 * t + 1].double()
        out[..., 2 * t], out[..., 2 * t + 1] = a * cos[:, t] - b * sin[:, t], a * sin[:, t] + b * cos[:, t]
    return out


def test_a_rotary_scheme_needs_only_rotation(unregister):
    # rotation() alone (has_rotation = True) was prepared and then never applied: the default rotate() returned q, k
    # unchanged, so the model equalled pos=none exactly under sdpa / eager / flex, while triton (which applies
    # state.rope itself) rotated
    register_pos("toy_rotation")(type("ToyRotation", (PositionScheme,), {"has_rotation": True, "rotation": _angles}))
    s = registry.build_pos("toy_rotation", num_heads=2, head_dim=8, grid=(3, 4))
    q, k = torch.randn(2, 2, 13, 8, dtype=torch.float64), torch.randn(2, 2, 13, 8, dtype=torch.float64)
    state = s.prepare((3, 4), 1)
    qr, kr = s.rotate(q, k, state)
    cos, sin = state.rope
    torch.testing.assert_close(qr, _naive_rope(q, cos, sin))
    torch.testing.assert_close(kr, _naive_rope(k, cos, sin))
    x = torch.randn(2, 13, 16)
    ref = _attend("toy_rotation", "eager", x)
    assert (ref - _attend("none", "eager", x)).abs().max() > 1e-2
    for impl in ("sdpa", "flex", "triton"):
        torch.testing.assert_close(_attend("toy_rotation", impl, x), ref, atol=1e-4, rtol=1e-4)


def test_a_scheme_with_its_own_rotate_is_rotated_by_it_under_every_kernel(unregister):
    # attn_impl='triton' applied state.rope as interleaved pairs in place of the scheme's rotate(): with GPT-NeoX's
    # halves it gave another function, silently (max |out - eager| 8.7 on a ViT-tiny block)
    attrs = {"has_rotation": True, "rotation": _angles, "rotate": _halves}
    register_pos("toy_halves")(type("ToyHalves", (PositionScheme,), attrs))
    x = torch.randn(2, 13, 16)
    ref = _attend("toy_halves", "eager", x)
    for impl in ("sdpa", "flex", "triton"):
        torch.testing.assert_close(_attend("toy_halves", impl, x), ref, atol=1e-4, rtol=1e-4)
    halves, shipped = registry.get_pos_class("toy_halves"), registry.get_pos_class("rope2d_axial")
    assert not halves.fusable_rotation() and shipped.fusable_rotation()  # vitrel's rotary schemes stay fused
    shipped = [c for c in map(registry.get_pos_class, registry.list_pos()) if c.__module__.startswith("vitrel.")]
    # (but V-JEPA 2's released form, one angle per channel, which no pair rotation computes)
    unfused = [c.name for c in shipped if c.has_rotation and not c.fusable_rotation()]
    assert unfused == ["rope3d_vjepa2"]


def test_the_docs_import_line_works_in_a_module_of_the_schemes_package():
    # a new vitrel/pos/schemes/<name>.py with the how-to's `from vitrel.pos import PositionScheme, register_pos` failed:
    # "cannot import name 'PositionScheme' from partially initialized module 'vitrel.pos'" (the package imports its
    # schemes first); the finder below runs that line where the first scheme module is imported
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class DocsImportLine(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path, target=None):
                if name.startswith("vitrel.pos.schemes."):
                    sys.meta_path.remove(self)
                    from vitrel.pos import PositionScheme, register_pos  # noqa: F401
                return None

        sys.meta_path.insert(0, DocsImportLine())
        import vitrel
        print(len(vitrel.list_pos()))
        """
    )
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=script_env(), capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-2000:]


# A learned bias over the bucketed Euclidean distance, written as the how-to says: one file, bias() only.
TOY_BUCKET = """
import torch
from torch import nn

from vitrel.layout.geometry import pad_prefix, rel_offsets
from vitrel.pos import PositionScheme, register_pos


@register_pos("toy_bucket")
class ToyBucket(PositionScheme):
    family = "learned bias"
    has_bias = True

    def __init__(self, *, num_buckets: int = 4, **kw) -> None:
        super().__init__(**kw)
        self.num_buckets = num_buckets
        self.table = nn.Parameter(torch.randn(self.num_heads, num_buckets))

    def bias(self, grid, num_prefix_tokens=0):
        dh, dw = rel_offsets(self.check_grid(grid), self.table.device)
        d = (dh**2 + dw**2).double().sqrt().floor().long().clamp(max=self.num_buckets - 1)
        return pad_prefix(self.table[:, d], num_prefix_tokens)
"""


def test_a_toy_bias_scheme_reaches_the_registry_study_kernels_and_training(tmp_path, monkeypatch, unregister):
    (tmp_path / "toy_schemes.py").write_text(TOY_BUCKET, encoding="utf-8")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, "toy_schemes", raising=False)
    import toy_schemes  # noqa: F401  (registers pos=toy_bucket)

    assert "toy_bucket" in vitrel.list_pos("relative")
    import vitrel.study as study

    rec = study.recipe("gpu")
    schemes, _, _ = study.select(study.parse_args(["--budget", "gpu"]), rec["study"])
    assert "toy_bucket" in schemes  # the study takes it, with no list to edit

    x = torch.randn(2, 13, 16)
    ref = _attend("toy_bucket", "eager", x)
    torch.testing.assert_close(_attend("toy_bucket", "sdpa", x), ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(_attend("toy_bucket", "auto", x), ref, atol=1e-5, rtol=1e-5)
    # the kernels that read another form of the bias refuse it, naming the hook and declaration that would add it
    for impl, hook in [("flex", "offset_table"), ("triton", "offset_table"), ("fold", "bias_factors")]:
        flag = "has_" + hook
        with pytest.raises(ValueError, match=rf"toy_bucket has no such .*defining {hook}\(\) and {flag} = True"):
            Attention(16, 2, pos="toy_bucket", grid=(3, 4), attn_impl=impl)

    from vitrel.train.run import train

    cfg = compose(tmp_path, [*TINY_VIT, *FAST, "pos=none", "pos.name=toy_bucket", "+pos.num_buckets=3", "debug=fdr"])
    metrics = train(cfg)
    assert metrics["test/loss"] == metrics["test/loss"]  # finite: one training step, validation and test ran


def test_howto_rotary_example_rotates_under_every_kernel_that_takes_it(unregister):
    """docs/schemes.md's rotary example (rotation() only) as written: its rotation is the interleaved one of its
    (cos, sin), and sdpa, flex and triton compute what eager does."""
    text = (ROOT / "docs" / "schemes.md").read_text(encoding="utf-8")
    section = text[text.index("\n## Adding a position scheme\n") :]
    blocks = section.split("```python\n")[1:3]
    head, code = blocks[0][: blocks[0].index("@register_pos")], blocks[1][: blocks[1].index("\n```")]
    ns: dict = {}
    exec(compile(head + "from vitrel.layout.geometry import patch_coords\n" + code, "docs/schemes.md", "exec"), ns)
    s = registry.build_pos("rope_random", num_heads=2, head_dim=8, grid=(3, 4)).double()
    q, k = torch.randn(2, 2, 13, 8, dtype=torch.float64), torch.randn(2, 2, 13, 8, dtype=torch.float64)
    state = s.prepare((3, 4), 1)
    qr, _ = s.rotate(q, k, state)
    for h in range(2):
        torch.testing.assert_close(qr[:, h], _naive_rope(q[:, h], state.rope[0][h], state.rope[1][h]))
    x = torch.randn(2, 13, 16)
    ref = _attend("rope_random", "eager", x)
    assert (ref - _attend("none", "eager", x)).abs().max() > 1e-2
    for impl in ("sdpa", "flex", "triton"):
        torch.testing.assert_close(_attend("rope_random", impl, x), ref, atol=1e-4, rtol=1e-4)
