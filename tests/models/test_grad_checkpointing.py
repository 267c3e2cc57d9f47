"""Gradient (activation) checkpointing, timm's ``model.set_grad_checkpointing()``, on every model family: the same
outputs and float64 gradients as without it (every parameter, position tables and MLPs included; dropout, drop path
and token dropping drawing the same numbers on recompute), under each CPU kernel, with prefix tokens, token dropping
and NaFlex inputs, under ``torch.compile``; and fewer bytes kept for the backward pass (a flag that stores as much
would be a silent no-op), back to as many with ``set_grad_checkpointing(False)``."""

from __future__ import annotations

import pytest
import torch

import vitrel
from tests.naflex_inputs import packed

D = torch.float64
VIT = dict(depth=3, embed_dim=32, num_heads=2)
SWIN = dict(embed_dim=16, depths=(2, 2, 1, 1), num_heads=(1, 2, 2, 4))
NAMES = {
    "vit": "vitrel_vit_tiny_patch4_32",
    "swin": "vitrel_swin_tiny_patch2_window4_32",
    "vvit": "vitrel_vit_video_tiny_patch4_32",
    "swin3d": "vitrel_swin3d_tiny_patch122_window444_32",
}
DROPS = dict(drop_path_rate=0.2, proj_drop_rate=0.1)


def _model(arch: str, **kw) -> torch.nn.Module:
    torch.manual_seed(0)
    sizes = VIT if arch in ("vit", "vvit") else SWIN
    return vitrel.create_model(NAMES[arch], **{**sizes, **kw}).to(D).train()


def _input(arch: str, m: torch.nn.Module, kind: str = "tensor", batch: int = 2):
    g = torch.Generator().manual_seed(1)
    c, h, w = m.pretrained_cfg["input_size"]
    if kind == "naflex":
        imgs = [torch.randn(3, h, w, generator=g) for h, w in [(16, 16), (12, 20), (20, 8)]]
        return {k: v.to(D) if v.is_floating_point() else v for k, v in packed(imgs).items()}
    if kind == "list":
        return [torch.randn(3, h, w, generator=g, dtype=D) for h, w in [(32, 32), (16, 24)]]
    shape = (batch, c, h, w) if arch in ("vit", "swin") else (batch, c, m.num_frames, h, w)
    return torch.randn(*shape, generator=g, dtype=D)


def _run(m: torch.nn.Module, x, ckpt: bool, seed: int = 5, net: torch.nn.Module | None = None):
    """Output and every parameter's gradient of ``sum(net(x)^2)`` (``net``: ``m`` or ``m`` compiled)."""
    m.zero_grad(set_to_none=True)
    m.set_grad_checkpointing(ckpt)
    torch.manual_seed(seed)
    y = (m if net is None else net)(x)
    y.square().sum().backward()
    return y.detach(), {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}


def _assert_same(a, b) -> None:
    torch.testing.assert_close(a[0], b[0], rtol=0, atol=1e-12)
    assert a[1].keys() == b[1].keys()
    for n in a[1]:
        torch.testing.assert_close(a[1][n], b[1][n], rtol=1e-10, atol=1e-12, msg=n)


CASES = [
    ("vit", "tensor", dict(pos="rel2d_full", attn_drop_rate=0.1)),
    ("vit", "tensor", dict(pos="rel2d_full", pos_share=True, attn_drop_rate=0.1, attn_impl="eager")),
    ("vit", "tensor", dict(pos="rel2d_cpb", reg_tokens=2, attn_impl="sdpa")),
    ("vit", "tensor", dict(pos="rope2d_mixed", pos_share=True, reg_tokens=2)),
    ("vit", "tensor", dict(pos="lookhere", attn_impl="eager")),
    ("vit", "tensor", dict(pos="shaw2d_full")),  # Shaw's own kernel checkpoints its query blocks inside
    ("vit", "tensor", dict(pos="rel2d_factored", attn_impl="fold", token_drop=0.5)),
    ("vit", "tensor", dict(pos="none", abs_pos="ape", class_token=False, global_pool="avg")),
    ("vit", "tensor", dict(pos="rope2d_axial", token_drop=[0.2, 0.6], reg_tokens=1)),
    ("vit", "naflex", dict(pos="rel2d_cpb", reg_tokens=1)),
    ("swin", "tensor", dict(pos="rel2d_cpb", attn_drop_rate=0.1)),
    ("swin", "tensor", dict(pos="rope2d_mixed", pos_share=True)),
    ("swin", "list", dict(pos="rel2d_full")),
    ("vvit", "tensor", dict(pos="rel3d_full")),
    ("vvit", "tensor", dict(pos="rope3d_mixed", abs_pos="sincos3d")),
    ("swin3d", "tensor", dict(pos="rel3d_full")),
    ("swin3d", "tensor", dict(pos="rope3d_axial")),
]


@pytest.mark.parametrize(
    "arch,kind,kw", CASES, ids=[f"{a}-{k}-" + "-".join(f"{n}={v}" for n, v in kw.items()) for a, k, kw in CASES]
)
def test_checkpointed_gradients_equal_plain_ones(arch, kind, kw):
    m = _model(arch, **DROPS, **kw)
    x = _input(arch, m, kind)
    plain = _run(m, x, False)
    _assert_same(_run(m, x, True), plain)
    with pytest.raises(AssertionError):  # the dropout is live: another seed draws other numbers
        _assert_same(_run(m, x, False, seed=6), plain)


def _saved_bytes(m: torch.nn.Module, x, net: torch.nn.Module | None = None) -> int:
    """Bytes of the distinct storages autograd keeps for the backward pass of one forward, outside checkpointed
    regions (inside, torch's own hooks hold nothing but what is recomputed)."""
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = (m if net is None else net)(x)
    y.sum().backward()
    m.zero_grad(set_to_none=True)
    return sum(seen.values())


@pytest.mark.parametrize(
    "arch,pos", [("vit", "rel2d_full"), ("swin", "rel2d_cpb"), ("vvit", "rope3d_mixed"), ("swin3d", "rel3d_full")]
)
def test_checkpointing_keeps_fewer_bytes_for_backward(arch, pos):
    """Measured (batch 2, float64): ViT 2.43 MiB -> 0.32, Swin 7.73 -> 1.96, video ViT 15.4 -> 1.1, Swin-3D 40.7 ->
    4.7. What stays is the patch embedding, the head and each block's position state, prepared once per forward
    outside the checkpointed blocks (rel2d_cpb's MLP over the window's offsets: about 1 MiB of the Swin's 1.96)."""
    m = _model(arch, pos=pos)
    x = _input(arch, m)
    plain = _saved_bytes(m, x)
    m.set_grad_checkpointing()
    assert m.grad_checkpointing
    ckpt = _saved_bytes(m, x)
    assert ckpt < 0.3 * plain, (ckpt, plain)
    m.set_grad_checkpointing(False)
    assert not m.grad_checkpointing
    assert _saved_bytes(m, x) == plain


def test_checkpointing_under_torch_compile():
    """aot_eager (the CPU's): the compiled network's gradients equal the eager one's, and it keeps fewer bytes
    (batch 8: 8.8 MiB -> 1.3; a batch of 2 keeps mostly rel2d_cpb's MLP, prepared outside the blocks)."""
    torch._dynamo.reset()
    m = _model("vit", pos="rel2d_cpb", reg_tokens=1, **DROPS)
    x = _input("vit", m)
    plain = _run(m, x, False)
    _assert_same(_run(m, x, True, net=torch.compile(m, backend="aot_eager")), plain)
    torch._dynamo.reset()
    m = _model("vit", pos="rel2d_full", **DROPS)
    x, net = _input("vit", m, batch=8), torch.compile(m, backend="aot_eager")
    plain = _saved_bytes(m, x, net)
    m.set_grad_checkpointing()
    assert _saved_bytes(m, x, net) < 0.3 * plain


@pytest.mark.parametrize("arch", list(NAMES))
def test_a_constructor_argument_names_the_switch(arch):
    """``+model.grad_checkpointing=true`` (a constructor argument, as no timm model takes) names the method and
    train.py's key."""
    with pytest.raises(TypeError, match=r"grad_checkpointing=True \(not built in: model.set_grad_checkpointing\(\)"):
        vitrel.create_model(NAMES[arch], grad_checkpointing=True)
