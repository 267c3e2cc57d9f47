"""A scheme registered from outside the package (``vitrel.pos.register_pos``): what its class must declare, and that
the registry refuses a class whose hooks and declarations disagree (the kernels read the declarations)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import timm
import torch
from torch import nn

import vitrel
import vitrel.pos.registry as registry
from tests.train_helpers import FAST, ROOT, TINY_VIT, script_env
from vitrel.layout.geometry import Grid, pad_prefix, rel_offsets
from vitrel.models.checkpoint import CheckpointError
from vitrel.pos import PositionScheme, list_pos, register_pos


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


@pytest.mark.parametrize(("hook", "flag"), [("offset_table", "has_offset_table"), ("bias_factors", "has_bias_factors")])
def test_a_form_of_the_bias_without_the_bias_is_refused(hook, flag, unregister):
    """An ``offset_table()`` alone (the protocol calls it the bias by offset) was registered, and every kernel computed
    ``pos=none``: they read it for a scheme with ``has_bias`` only."""
    cls = type("Mine", (PositionScheme,), {hook: lambda self, *a, **k: None, flag: True})
    with pytest.raises(TypeError, match=rf"Mine declares {flag} = True but has_bias = False: .* set has_bias = True"):
        register_pos("mine")(cls)


def test_a_name_registered_twice_says_by_whom(unregister):
    with pytest.raises(
        ValueError, match=r"'rel2d_full' is registered twice: vitrel.pos.schemes.bias2d.\w+ has it; choose"
    ):
        register_pos("rel2d_full")(type("Mine", (PositionScheme,), {}))
    first = register_pos("mine")(type("Mine", (PositionScheme,), {}))
    with pytest.raises(ValueError, match=r"defined again \(a notebook cell run twice\): restart the kernel"):
        register_pos("mine")(type("Mine", (PositionScheme,), {"__module__": first.__module__}))


@pytest.mark.parametrize(
    ("hook", "wrong", "says"),
    [
        (
            "bias",
            lambda self, grid, p=0: torch.zeros(2, 12, 12),
            r"bias\(\) returned \(2, 12, 12\), expected \[2, 13, 13\] .*pad_prefix",
        ),
        (
            "offset_table",
            lambda self, grid: torch.zeros(5, 7, 2),
            r"offset_table\(\) returned \(5, 7, 2\), expected \[2, 5, 7\]",
        ),
    ],
)
def test_a_bias_of_another_shape_is_named_before_a_kernel_reads_it(hook, wrong, says, unregister):
    """A bias without its prefix rows failed inside SDPA with a bare broadcasting error; a table in Swin's
    ``[2H-1, 2W-1, heads]`` layout failed inside flex's compiled code (index out of bounds)."""
    from vitrel.kernels import get_kernel

    good = {"bias": _distance_bias(), "offset_table": lambda self, grid: torch.zeros(2, 5, 7)}
    hooks = {**good, hook: wrong, "has_bias": True, "has_offset_table": True}

    def init(self, **kw):
        PositionScheme.__init__(self, **kw)
        self.width = nn.Parameter(torch.ones(self.num_heads))

    register_pos("mine")(type("Mine", (PositionScheme,), {"__init__": init, **hooks}))
    s = registry.build_pos("mine", num_heads=2, head_dim=4, grid=(3, 4), num_prefix_tokens=1)
    kernel = get_kernel("sdpa" if hook == "bias" else "flex")
    with pytest.raises(ValueError, match=says):
        s.prepare(Grid(3, 4), 1, torch.device("cpu"), torch.float32, kernel=kernel)


def test_a_tensor_kept_as_a_plain_attribute_is_refused(unregister):
    """``self.w = torch.randn(...)`` was not in the state dict: a strict reload drew it anew (outputs off by 1.5e-2)."""

    def init(self, **kw):
        PositionScheme.__init__(self, **kw)
        self.width = torch.rand(self.num_heads)

    register_pos("mine")(
        type("Mine", (PositionScheme,), {"__init__": init, "bias": _distance_bias(), "has_bias": True})
    )
    with pytest.raises(TypeError, match=r"Mine: self.width is a tensor kept as a plain attribute.*nn.Parameter"):
        registry.build_pos("mine", num_heads=2, head_dim=4, grid=(3, 4))


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


# ------------------------------------------------------ docs/schemes.md's "Adding a position scheme", as written
HOWTO = "docs/schemes.md"


def scheme_howto() -> tuple[str, str]:
    """The section's Python block (the scheme) and the launcher its bash block writes."""
    text = (ROOT / HOWTO).read_text(encoding="utf-8")
    section = text[text.index("\n## Adding a position scheme\n") + 1 :]
    end = section.find("\n## ")
    section = section if end < 0 else section[:end]
    code = section[section.index("```python\n") + 10 :]
    code = code[: code.index("\n```")]
    launcher = section[section.index("<<'EOF'\n") + 8 :]
    return code, launcher[: launcher.index("\nEOF\n")]


def test_howto_gauss2d_is_the_bias_it_states(unregister):
    code, _ = scheme_howto()
    ns: dict = {}
    exec(compile(code, HOWTO, "exec"), ns)
    model = ns["model"]
    pos = model.blocks[0].attn.pos
    assert pos.name == "gauss2d" and torch.equal(pos.width.detach(), torch.full((pos.num_heads,), 0.5))
    assert model.vitrel_cfg["pos"] == {"name": "gauss2d", "init_width": 0.5}
    g = Grid(3, 4)
    b = pos.bias(g, 1).detach()
    for i in range(g.n):
        for j in range(g.n):
            d2 = (i // 4 - j // 4) ** 2 + (i % 4 - j % 4) ** 2
            torch.testing.assert_close(b[:, 1 + i, 1 + j], -0.5 * d2 * torch.ones(pos.num_heads))
    assert b[:, 0].abs().sum() == 0 and b[:, :, 0].abs().sum() == 0


def test_howto_launcher_trains_a_scheme_from_outside_the_package(tmp_path, unregister):
    code, launcher = scheme_howto()
    (tmp_path / "my_schemes.py").write_text(code, encoding="utf-8")
    (tmp_path / "my_train.py").write_text(launcher, encoding="utf-8")
    (tmp_path / "my_conf" / "pos").mkdir(parents=True)
    (tmp_path / "my_conf" / "pos" / "gauss2d.yaml").write_text("name: gauss2d\ninit_width: 0.1\n", encoding="utf-8")
    run = tmp_path / "run"
    args = ["pos=gauss2d", "pos.init_width=0.5", f"hydra.searchpath=[file://{tmp_path / 'my_conf'}]", *TINY_VIT]
    args += [*FAST, "trainer.max_steps=1", "trainer.limit_val_batches=1", "trainer.limit_test_batches=1"]
    args += ["logger=none", f"hydra.run.dir={run}"]
    env = script_env()
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), env["PYTHONPATH"]])
    r = subprocess.run(
        [sys.executable, "my_train.py", *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-4000:]
    ckpt = run / "checkpoints" / "last.ckpt"
    with pytest.raises(CheckpointError, match="unknown position scheme 'gauss2d'.*once the module that registers"):
        vitrel.load_model(ckpt)  # this process has not imported it yet
    exec(compile(code, HOWTO, "exec"), {})  # import my_schemes, as the how-to says
    model = vitrel.load_model(ckpt)
    assert model.vitrel_cfg["pos"] == {"name": "gauss2d", "init_width": 0.5}
    assert not torch.equal(model.blocks[0].attn.pos.width.detach(), torch.full((2,), 0.5))  # trained one step
    t = timm.create_model("vitrel_vit_tiny_patch4_32", pos="gauss2d", num_classes=3)
    assert t.blocks[0].attn.pos.name == "gauss2d"


@pytest.mark.parametrize("name", list_pos())
def test_grid_hooks_take_a_plain_tuple(name):
    # scheme.bias((7, 7)) (as Attention.bias takes it) raised "'tuple' object has no attribute 'h'" in most schemes
    cls = registry.get_pos_class(name)
    sides = (2, 3, 3) if cls.grid_dims == 3 else (3, 4)
    s = registry.build_pos(name, num_heads=2, head_dim=24, grid=sides)
    g = s.check_grid(sides)
    calls = {"bias": (1,), "offset_table": (), "bias_factors": (1,), "rotation": (1, None, None)}
    for hook, args in calls.items():
        if getattr(cls, hook) is getattr(PositionScheme, hook):
            continue
        want, got = getattr(s, hook)(g, *args), getattr(s, hook)(sides, *args)
        for a, b in zip(*(x if isinstance(x, tuple) else (x,) for x in (want, got))):
            torch.testing.assert_close(a, b)


def test_a_random_buffer_left_out_of_the_state_dict_is_refused(unregister):
    """``register_buffer("w", torch.randn(...), persistent=False)``: not saved, so a reload in another process drew
    another ``w`` (another model from the same weights). A fixed one (frequencies from the options) is fine."""

    def init(self, random: bool = True, **kw):
        PositionScheme.__init__(self, **kw)
        made = torch.rand(self.num_heads) if random else torch.arange(float(self.num_heads))
        self.register_buffer("width", made, persistent=False)

    cls = type("Mine", (PositionScheme,), {"__init__": init, "bias": _distance_bias(), "has_bias": True})
    register_pos("mine")(cls)
    registry.build_pos({"name": "mine", "random": False}, num_heads=2, head_dim=4, grid=(3, 4))
    with pytest.raises(TypeError, match=r"Mine: buffer width is drawn at random.*persistent=False.*persistent"):
        registry.build_pos("mine", num_heads=2, head_dim=4, grid=(3, 4))
