"""timm's model surface, written once for both backbones (:class:`~vitrel.models.VisionTransformer` and
:class:`~vitrel.models.SwinTransformer`): the classifier (``get_classifier`` / ``reset_classifier`` /
``forward_head`` / ``forward``), ``no_weight_decay``, and the index / format / pruning plumbing of
``forward_intermediates`` and ``prune_intermediate_layers``.

A backbone says what differs in a few class attributes and hooks:

* ``global_pools``: the ``global_pool`` values it takes (the error message lists them in this order);
* ``trunk``: the attribute holding its sequence of blocks or stages (one feature per entry, ``feature_info``);
* ``intermediate_fmts``: the ``output_fmt`` values of its ``forward_intermediates``;
* ``no_weight_decay_params``: its own parameters (besides the schemes') kept out of weight decay;
* ``pool(x)``: features -> pooled features; ``pooled(x)`` (default ``pool``) adds what comes before the
  head dropout (the ViT's ``fc_norm``); ``check_global_pool`` for extra rules (the ViT's class token).

``forward`` stays in each backbone's own module: ``torch.fx`` wraps the notrace functions
(``register_notrace_function``) found in the globals of the module that defines the root ``forward``.
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from timm.models._features import feature_take_indices
from torch import Tensor, nn

from vitrel.caller import caller_stacklevel
from vitrel.layers.validate import check_num_classes
from vitrel.models.blocks import init_weights_, scheme_no_weight_decay
from vitrel.models.ckpt_files import CheckpointError, clean_state_dict, has_ema_keys
from vitrel.models.input_size import resolve_strict_img_size

__all__ = ["TimmSurface", "take_indices", "timm_attn_mask", "refuse_layout_mask"]


def _alternatives(values: tuple[str, ...]) -> str:
    """``('a', 'b', '')`` -> ``"'a', 'b' or ''"``."""
    return f"{', '.join(map(repr, values[:-1]))} or {values[-1]!r}" if len(values) > 1 else repr(values[0])


def take_indices(n: int, indices: Any, what: str = "blocks") -> tuple[list[int], int]:
    """timm's ``feature_take_indices`` (the indices asked for, the last of them) with a ``ValueError`` naming what a
    model of ``n`` blocks / stages takes for indices it does not have (timm's: an ``AssertionError``)."""
    try:
        return feature_take_indices(n, indices)
    except (AssertionError, TypeError) as e:
        said = f" ({e})" if isinstance(e, TypeError) and str(e) else ""  # (timm's range text is of its own indices)
        raise ValueError(
            f"indices {indices!r} do not fit a model of {n} {what}: give the last k (an int, 1 to {n}) or a list of "
            f"indices from {-n} to {n - 1}{said}"
        ) from None


def timm_attn_mask(attn_mask: Tensor | None, is_causal: bool, tokens: Tensor, num_heads: int) -> Tensor | None:
    """timm's ``attn_mask`` / ``is_causal`` of a ViT's ``forward`` for the embedded ``tokens [B, N, C]`` (``N``: the
    prefix and patch tokens) as the mask every block adds to its logits with the position bias, SDPA's semantics: a
    bool mask (True: attend) or an additive float one, broadcast from the right to ``[B, heads, N, N]`` (made 4-D
    here, so a 3-D one is ``[heads, N, N]`` as in SDPA, not a Swin window mask); ``is_causal``: each token attends to
    itself and the tokens before it. None for neither. Both together, a mask of another dtype or one that does not
    broadcast, are a ``ValueError`` naming the fix."""
    if attn_mask is None and not is_causal:
        return None
    b, n = tokens.shape[:2]
    if is_causal:
        if attn_mask is not None:
            raise ValueError(
                "attn_mask and is_causal=True together (SDPA refuses them, timm's eager path drops the mask): "
                f"pass one, e.g. attn_mask & torch.ones({n}, {n}, dtype=torch.bool).tril() for both"
            )
        return torch.ones(n, n, dtype=torch.bool, device=tokens.device).tril()[None, None]
    if not isinstance(attn_mask, Tensor) or not (attn_mask.dtype == torch.bool or attn_mask.is_floating_point()):
        what = attn_mask.dtype if isinstance(attn_mask, Tensor) else type(attn_mask).__name__
        raise ValueError(f"attn_mask must be a bool (True: attend) or float (added to the logits) tensor, got {what}")
    want = (b, num_heads, n, n)
    shape = tuple(attn_mask.shape)
    if not 2 <= len(shape) <= 4 or any(s not in (1, w) for s, w in zip(reversed(shape), reversed(want))):
        raise ValueError(
            f"attn_mask of shape {list(shape)} does not broadcast to [B, heads, N, N] = {list(want)} (N: the "
            f"{n} tokens, prefix tokens first, then the patches in raster order): give [N, N], [B | 1, heads | 1, "
            "N, N], or a key padding mask [B, N] as mask[:, None, None, :]"
        )
    return attn_mask.reshape((1,) * (4 - len(shape)) + shape).to(tokens.device)


def refuse_layout_mask(attn_mask: Tensor | None, is_causal: bool) -> None:
    """``attn_mask`` / ``is_causal`` with an input on a token layout: one ``ValueError`` saying what takes them."""
    if attn_mask is not None or is_causal:
        raise ValueError(
            "attn_mask and is_causal take a batch of images [B, C, H, W] (one grid, N = prefix + patch tokens): a "
            "NaFlex dict or a list of images is masked by its own layout, and token_drop (in training) changes N; "
            "call model.eval() (token_drop), or give the images as one batch"
        )


class TimmSurface:
    """Mixin of a vitrel backbone (an ``nn.Module`` with ``patch_embed``, ``head_drop``, ``head``,
    ``feature_info`` and ``vitrel_cfg``) giving it timm's classifier and feature surface (module docstring)."""

    global_pools: tuple[str, ...] = ("avg", "")
    trunk: str = "blocks"
    intermediate_fmts: tuple[str, ...] = ("NCHW",)
    no_weight_decay_params: tuple[str, ...] = ()

    # attributes the backbone sets
    num_features: int
    head: nn.Module
    head_drop: nn.Module
    patch_embed: nn.Module
    feature_info: list[dict[str, Any]]
    vitrel_cfg: dict[str, Any]

    def init_surface(
        self,
        in_chans: int,
        img_size: tuple[int, int],
        global_pool: str,
        dynamic_img_size: bool | None,
        strict_img_size: bool | None,
    ) -> None:
        """The timm attributes of the input and the pooling (``strict_img_size``: :mod:`vitrel.models.input_size`)."""
        self.in_chans = in_chans
        self.img_size = img_size
        self.strict_img_size = resolve_strict_img_size(dynamic_img_size, strict_img_size)
        self.dynamic_img_size = not self.strict_img_size
        self.global_pool = global_pool

    def check_global_pool(self, global_pool: str) -> None:
        if global_pool not in self.global_pools:
            raise ValueError(f"global_pool must be {_alternatives(self.global_pools)}, got {global_pool!r}")

    @property
    def _model_args(self) -> dict[str, Any]:
        """timm's record of the constructor arguments (``timm.models.get_model_args``, which ``save_for_hf`` and
        ``push_to_hf_hub`` write as ``config.json``'s ``model_args`` for ``local-dir:`` / ``hf-hub:``): every one, as
        ``vitrel_cfg`` holds it now (after ``reset_classifier``, ``set_input_size`` ...), with its ``vitrel_format``."""
        return copy.deepcopy({k: v for k, v in self.vitrel_cfg.items() if k != "architecture"})

    @_model_args.setter
    def _model_args(self, value: Mapping[str, Any]) -> None:
        """timm's factory records the keyword arguments it was given here; ``vitrel_cfg`` holds them all already."""

    def init_weights(self, mode: str = "", needs_reset: bool = True) -> None:
        """timm's ``init_weights``. ``needs_reset=True`` (timm's default, for after ``to_empty()``, which leaves every
        parameter and persistent buffer undefined): all of them as the constructor makes them (position tables and
        MLPs, ``rel2d_cpb``'s ``ref_grid``, the patch and absolute embeddings), copied from a model of this class built
        from ``vitrel_cfg`` on this one's device and dtype. ``needs_reset=False`` (the constructor's): timm's ViT
        initialisation of the linear layers and norms outside the schemes (:func:`~vitrel.models.blocks.init_weights_`).
        ``mode``: timm's ``""`` only."""
        if mode:
            raise ValueError(f"init_weights takes timm's default mode '' only, got {mode!r}")
        if not needs_reset:
            init_weights_(self)  # type: ignore[arg-type]
            self._scale_head()
            return
        ref = next(self.parameters())  # type: ignore[attr-defined]
        args = {k: v for k, v in self.vitrel_cfg.items() if k not in ("architecture", "vitrel_format")}  # type: ignore[attr-defined]
        fresh = type(self)(**args, device=ref.device, dtype=ref.dtype)  # (this class's own, current-format arguments)
        missing = self.load_state_dict(fresh.state_dict(), strict=False).missing_keys  # type: ignore[attr-defined]
        if missing:
            raise ValueError(f"init_weights: vitrel_cfg builds no {missing[:4]} ({len(missing)} in all)")

    # ---------------------------------------------------------------------------- classifier
    @torch.jit.ignore
    def no_weight_decay(self) -> set[str]:
        """Position tables / frequencies (each scheme's ``no_weight_decay_keys``), absolute embeddings, the
        backbone's ``no_weight_decay_params`` (the ViT's class and register tokens) and the cosine attention's logit
        scales (as timm's Swin V2)."""
        out = scheme_no_weight_decay(self)  # type: ignore[arg-type]
        out.update(n for n in self.no_weight_decay_params if getattr(self, n, None) is not None)
        out.update(n for n, _ in self.named_parameters() if n.endswith(".attn.logit_scale"))
        return out

    @torch.jit.ignore
    def get_classifier(self) -> nn.Module:
        return self.head

    def reset_classifier(self, num_classes: int, global_pool: str | None = None) -> None:
        """A new head for ``num_classes`` (none for 0), on the device and in the dtype of the model's weights and in
        its mode (``training``, as timm's models: a model in eval mode gets a head in eval mode), and a new
        ``global_pool`` if given; ``vitrel_cfg`` follows."""
        num_classes = check_num_classes(num_classes)
        if global_pool is not None:
            self.check_global_pool(global_pool)
            self.global_pool = global_pool
            self.vitrel_cfg["global_pool"] = global_pool
            if "fc_norm" in self.vitrel_cfg:  # the norms stay as built (timm's): recorded, not the new pool's default
                self.vitrel_cfg["fc_norm"] = not isinstance(self.fc_norm, nn.Identity)
        self.num_classes = num_classes
        self.vitrel_cfg["num_classes"] = num_classes
        w = self.patch_embed.proj.weight  # the new head on the model's device and dtype (meta, float64 ...)
        like = {"device": w.device, "dtype": w.dtype}
        self.head = nn.Linear(self.num_features, num_classes, **like) if num_classes > 0 else nn.Identity()
        if isinstance(self.head, nn.Linear):
            nn.init.trunc_normal_(self.head.weight, std=0.02)
            nn.init.zeros_(self.head.bias)
            self._scale_head()
        self.head.train(self.training)

    def _scale_head(self) -> None:
        """A new head's weight times ``vitrel_cfg["head_init_scale"]`` (timm's EVA's ``head_init_scale``; its bias
        starts at zero)."""
        scale = float(self.vitrel_cfg.get("head_init_scale", 1.0))  # type: ignore[attr-defined]
        head = getattr(self, "head", None)
        if scale != 1.0 and isinstance(head, nn.Linear):
            with torch.no_grad():
                head.weight.mul_(scale)

    # ---------------------------------------------------------------------------- weights
    def load_state_dict(self, state_dict: Mapping[str, Any], strict: bool = True, assign: bool = False) -> Any:
        """``nn.Module.load_state_dict``, reading vitrel's files as timm's ``load_checkpoint`` hands them over
        (``timm.create_model(name, checkpoint_path=...)``): its ``use_ema=True`` (the default) hands over the EMA copy
        train.py stores as ``state_dict_ema`` (the network's own keys); ``use_ema=False``, or a checkpoint written
        before vitrel stored that, the training module's state dict (the network under ``model.*``, beside the EMA
        copy and the metrics), of which the ``model.*`` weights load: the live ones, with a warning where the file
        holds an EMA copy (timm hands over the state dict only, not the run's ``ema_eval``; ``vitrel.load_model``
        and the ``pretrained_cfg_overlay=dict(file=...)`` route read it); weights that do not fit this model (built
        from other arguments than the stored ones) are one ``CheckpointError`` naming the routes that rebuild the model
        from its stored arguments."""
        own = nn.Module.state_dict(self)  # type: ignore[arg-type]
        if any(k.startswith("model.") for k in state_dict) and not any(k.startswith("model.") for k in own):
            if has_ema_keys(state_dict):  # (not the weights eval.py and predict.py score)
                warnings.warn(
                    "loading the live weights (model.*) of a training checkpoint that also holds an EMA copy, which "
                    "its run validated and tested (unless module.ema_eval=false) and eval.py and predict.py score: "
                    "timm's load_checkpoint(model, <file>, use_ema=True) loads the copy of a checkpoint that stores "
                    "it as state_dict_ema (train.py's, from this version on); vitrel.load_model(<file>) or "
                    "timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=<file>)) load the "
                    "weights the run tested",
                    stacklevel=caller_stacklevel(),
                )
            state_dict = clean_state_dict(state_dict, "model.")
        try:
            return nn.Module.load_state_dict(self, state_dict, strict=strict, assign=assign)  # type: ignore[arg-type]
        except RuntimeError as e:
            lines = str(e).strip().splitlines()
            if not strict or not lines or not lines[0].startswith("Error(s) in loading state_dict"):
                raise
            reasons = "\n".join(f"  {line.strip()[:300]}" for line in lines[1:5])
            raise CheckpointError(
                f"the weights do not fit this {type(self).__name__} ({self._architecture()}):\n"
                f"{reasons}\nvitrel's checkpoints and exports store the model's arguments (pos, depth, img_size, "
                "num_classes ...); timm.create_model(name, checkpoint_path=...) builds the model from the arguments "
                "given to it only: give the same ones, or load through a route that reads them: "
                "timm.create_model('local-dir:<export folder>', pretrained=True), "
                "timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=<weights file>)) or "
                "vitrel.load_model(<weights file or folder>)"
            ) from None

    def _architecture(self) -> str:
        """The registered name it was built as (``vitrel_cfg``'s, else timm's ``pretrained_cfg``'s), else its class."""
        cfg = getattr(self, "pretrained_cfg", None) or {}
        return self.vitrel_cfg.get("architecture") or cfg.get("architecture") or type(self).__name__

    def pool(self, x: Tensor) -> Tensor:  # pragma: no cover - overridden
        raise NotImplementedError

    def pooled(self, x: Tensor) -> Tensor:
        """Features -> what the head dropout and the head see (``pool`` unless the backbone adds to it)."""
        return self.pool(x)

    def forward_head(self, x: Tensor, pre_logits: bool = False) -> Tensor:
        x = self.head_drop(self.pooled(x))
        return x if pre_logits else self.head(x)

    # ---------------------------------------------------------------------------- intermediates
    def intermediate_indices(
        self, indices: int | list[int] | None, output_fmt: str, stop_early: bool
    ) -> tuple[list[int], nn.Module]:
        """``forward_intermediates``' plumbing: the trunk indices to return (the last ``n`` for an int, all for
        None, negative ones from the end) and the trunk entries to run (up to the last asked for with
        ``stop_early``). A ``ValueError`` for an ``output_fmt`` the backbone does not give."""
        if output_fmt not in self.intermediate_fmts:
            raise ValueError(f"output_fmt must be {_alternatives(self.intermediate_fmts)}, got {output_fmt!r}")
        seq = getattr(self, self.trunk)
        take, max_index = take_indices(len(seq), indices, "stages" if self.trunk == "layers" else "blocks")
        return take, seq[: max_index + 1] if stop_early else seq

    def prune_trunk(self, indices: int | list[int]) -> tuple[list[int], int]:
        """``prune_intermediate_layers``' plumbing: keep the trunk entries up to the last of ``indices`` (and
        their ``feature_info``); returns the absolute indices asked for and the last one kept."""
        seq = getattr(self, self.trunk)
        take, max_index = take_indices(len(seq), indices, "stages" if self.trunk == "layers" else "blocks")
        setattr(self, self.trunk, seq[: max_index + 1])
        self.feature_info = self.feature_info[: max_index + 1]
        return take, max_index
