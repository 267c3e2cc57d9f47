"""``vitrel.create_model`` and the registration of every architecture in timm's registry.

Every architecture is registered with timm on ``import vitrel``, so both of these work::

    vitrel.create_model("vitrel_swin_tiny_patch4_window7_224", pos="rel2d_factored")
    timm.create_model("vitrel_vit_small_patch16_224", pos="rope2d_mixed", num_classes=10)

timm's local-weights routes load our exported weights (``model.safetensors`` + ``config.json``, see
``vitrel.export_model``)::

    timm.create_model(name, pretrained=True, pretrained_cfg_overlay=dict(file=".../model.safetensors"))
    timm.create_model("local-dir:/path/to/export", pretrained=True)   # (without pretrained: new weights)

With the ``file`` route the architecture's stored arguments (position scheme, size, classes ...) are
read from the ``config.json`` beside the weights (or the safetensors metadata) and used as defaults,
so they need not be typed again; explicit keyword arguments still win. The stored data config (the training data's
mean, std, input size, crop, class names) goes into the model's ``pretrained_cfg``, as with ``local-dir:``.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

from timm.models import register_model
from torch import nn

from vitrel.models.checkpoint import (
    CheckpointError,
    checkpoint_scores_ema,
    clean_state_dict,
    load_model,
    read_weights,
    scheme_name,
    stored_config,
    timm_route,
    warn_other_function,
)
from vitrel.models.ckpt_files import _resolve, run_checkpoint
from vitrel.models.data_config import (
    TIMM_CFG_FIELDS,
    data_fields,
    fit_data_config,
    pretrained_cfg_fields,
    stored_data_config,
    warn_no_data_config,
)
from vitrel.models.registry import MODEL_ARGS, build, check_architecture, default_cfgs, list_models, split_feature_args
from vitrel.models.timm_import import from_timm
from vitrel.models.videomae_import import VIDEOMAE_SIZES, from_videomae
from vitrel.models.vjepa2_import import RELEASED as VJEPA2
from vitrel.models.vjepa2_import import from_vjepa2

# timm's register_model reads the pretrained configs from the entry point's module as `default_cfgs`
__all__ = ["create_model", "list_models", "default_cfgs", "TRANSFERABLE"]


def _strip_prefixes(state_dict: dict, model: nn.Module) -> dict:
    """timm ``pretrained_filter_fn``: accept a Lightning / torch.compile state dict (``model.``,
    ``_orig_mod.`` prefixes) as well as a plain one; tables and absolute embeddings resize themselves
    when they load (see ``vitrel.pos.tables.ResizeOnLoad``)."""
    return clean_state_dict(state_dict)


def _stored_weights(path: str, use_ema: bool) -> Callable[[dict, nn.Module], dict]:
    """timm ``pretrained_filter_fn`` of a file that stores its model's arguments: the weights ``load_model`` reads
    from it (``use_ema``: the EMA copy, the weights the run scored), read by vitrel, whichever entry timm's
    ``load_state_dict`` took. timm takes ``state_dict_ema`` when a checkpoint holds one (train.py's with
    ``module/ema``): the EMA copy also where the run scored its live weights (``module.ema_eval=false``)."""

    def weights(state_dict: dict, model: nn.Module) -> dict:
        return read_weights(path, use_ema=use_ema)[1]

    return weights


def _build(name: str, pretrained: bool = False, **kwargs: Any) -> nn.Module:
    """timm's route: ``pretrained=True`` with ``pretrained_cfg_overlay=dict(file=...)`` takes the
    architecture's stored arguments from the file as defaults. The stored preprocessing (that route's, or the
    ``pretrained_cfg`` of timm's ``local-dir:`` / ``hf-hub:`` routes) goes into the model's ``pretrained_cfg`` as
    ``load_model`` puts it (:func:`~vitrel.models.data_config.fit_data_config`)."""
    given = dict(kwargs.pop("pretrained_cfg_overlay", None) or {})
    overlay = dict(given)
    stored_data = stored_classes = no_data = built_at = None
    differ: list[str] = []  # the arguments given unlike the file's stored ones
    weights, stored, asked = _strip_prefixes, None, dict(kwargs)
    if pretrained and overlay.get("file"):
        # a train.py run folder or an export folder, as load_model takes them: the file load_model reads there (the
        # run's, logged; the export's weights). timm's loader reads a file, and the arguments below are that file's
        overlay["file"] = str(_resolve(run_checkpoint(overlay["file"])))
        stored = stored_config(overlay["file"])
        if stored is not None:
            arch = stored.get("architecture")
            if arch is not None and arch != name:
                raise CheckpointError(f"{overlay['file']} holds a {arch} model, not {name}{timm_route(arch)}")
            differ = [f"{k}={kwargs[k]!r} (stored: {v!r})" for k, v in stored.items() if _differs(k, kwargs, v)]
            for k, v in stored.items():
                if k != "architecture":
                    kwargs.setdefault(k, v)
            # the weights load_model, eval.py and predict.py score
            weights = _stored_weights(overlay["file"], checkpoint_scores_ema(overlay["file"]))
            stored_classes, built_at = stored.get("num_classes"), stored.get("img_size")
            if stored_classes is not None:
                overlay.setdefault("num_classes", stored_classes)
            stored_data = stored_data_config(overlay["file"])  # the training data's preprocessing: pretrained_cfg
            no_data = overlay["file"] if stored_data is None else None
            if stored_data is not None:  # (the source's input size as stored: timm adapts in_chans from it)
                for k, v in pretrained_cfg_fields(stored_data).items():
                    if k in TIMM_CFG_FIELDS:  # (num_frames is not: the model takes the stored one)
                        overlay.setdefault(k, v)
        else:  # a plain state dict: pretrained_cfg's num_classes is its head's (timm drops a head whose num_classes
            # differs from pretrained_cfg's and then loads the rest non-strictly)
            head = read_weights(overlay["file"], lazy=True)[1].get("head.weight")  # its shape: the rest stays on disk
            if head is not None:  # (and the model's when none is given, as timm takes pretrained_cfg's)
                overlay.setdefault("num_classes", head.shape[0])
                kwargs.setdefault("num_classes", overlay["num_classes"])
    elif isinstance(kwargs.get("pretrained_cfg"), dict) and kwargs.get("pretrained_model_args"):
        # timm's local-dir: / hf-hub: route (a config.json's pretrained_cfg and model_args)
        stored_data = data_fields(kwargs["pretrained_cfg"]) or None
        stored_classes = kwargs["pretrained_model_args"].get("num_classes", kwargs["pretrained_cfg"].get("num_classes"))
        built_at = kwargs["pretrained_model_args"].get("img_size")
    try:
        model = build(name, pretrained, pretrained_filter_fn=weights, pretrained_cfg_overlay=overlay, **kwargs)
    except CheckpointError as e:
        if not differ:
            raise
        raise CheckpointError(
            f"{overlay['file']} does not load into a {name} built with {', '.join(differ)}: the file stores the "
            f"arguments its model was trained with, taken for those not given; leave these out:\n"
            + "\n".join(line for line in str(e).splitlines()[1:] if line.startswith("  "))  # (the keys)
        ) from None
    if differ:  # weights that fit arguments given unlike the stored ones: load_model's warning (the network's own
        # configuration; fx / list / dict wrappers rebuild it from its parts, without one)
        net = next((m for m in model.modules() if hasattr(m, "vitrel_cfg")), None)
        warn_other_function(overlay["file"], stored, net.vitrel_cfg if net is not None else kwargs, asked)
    if stored_data is not None:
        fit_data_config(model, stored_data, stored_classes, given, built_at)
    if no_data is not None:
        warn_no_data_config(no_data, model)
    return model


def _differs(key: str, given: dict, stored: Any) -> bool:
    """``given[key]`` is not the stored value (a scheme by its name; tuples as lists)."""
    if key == "architecture" or key not in given:
        return False

    def norm(v: Any) -> Any:
        return [norm(x) for x in v] if isinstance(v, (list, tuple)) else v

    if key == "pos":
        return scheme_name(given[key]) != scheme_name(stored)
    return norm(given[key]) != norm(stored)


def _make_entrypoint(name: str) -> Callable[..., nn.Module]:
    def entry(pretrained: bool = False, **kwargs: Any) -> nn.Module:
        return _build(name, pretrained=pretrained, **kwargs)

    entry.__name__ = name
    entry.__qualname__ = name
    entry.__module__ = __name__
    entry.__doc__ = f"vitrel {name} ({MODEL_ARGS[name][0].__name__}); any position scheme via ``pos=``."
    return entry


for _name in MODEL_ARGS:
    globals()[_name] = register_model(_make_entrypoint(_name))


def create_model(
    name: str,
    pretrained: bool = False,
    checkpoint_path: str | None = None,
    pos: str | dict | None = None,
    num_classes: int | None = None,
    img_size: int | tuple[int, int] | None = None,
    in_chans: int | None = None,
    init_from: str | None = None,
    init_file: str | None = None,
    **kwargs: Any,
) -> nn.Module:
    """Build a vitrel model by name (timm-style).

    Args:
        name: one of :func:`list_models`.
        pretrained: load weights through timm's pretrained machinery (needs
            ``pretrained_cfg_overlay=dict(file=...)``; there are no hosted weights).
        checkpoint_path: weights to load after construction: a training checkpoint (``.ckpt``),
            exported weights (``.safetensors`` or an export directory) or, as in
            ``timm.create_model(..., checkpoint_path=...)``, a plain state dict (``.safetensors``,
            ``.pth``, ``.bin``). When the file stores its configuration, that gives the defaults
            (position scheme, sizes...) and the arguments given here override them; a different
            ``num_classes`` resets the head. A plain state dict is loaded strictly into the model the
            arguments describe (:class:`CheckpointError` naming the missing / unexpected keys when it
            does not fit). Tables and absolute embeddings are resized to ``img_size``. With
            ``features_only=True`` (``out_indices``...): the loaded network as timm's backbone.
        pos: position scheme name or config dict (``{"name": ..., **options}``).
        num_classes, img_size, in_chans: as timm; None keeps the architecture's default.
        init_from: ``"timm:<name>[.<tag>]"``: start from that timm model's weights (:func:`vitrel.from_timm`;
            downloaded through timm unless ``init_file`` is given). The architecture is then the timm
            model's: ``name`` and architecture arguments here are not used (a warning lists them);
            ``pos``, ``num_classes``, ``img_size``, ``in_chans``, ``abs_pos``, ``pos_share`` and the
            dropout / drop-path rates apply. ``"vjepa2:<encoder>"`` (``vit_large``, ``vit_huge``, ``vit_giant``,
            ``vit_giant_384``, ``vit_ac_giant``): that V-JEPA 2 encoder (:func:`vitrel.from_vjepa2`; ``pos`` None:
            ``rope3d_vjepa2``, their function; ``num_frames``, ``num_segments`` and the head's pool arguments,
            ``global_pool`` and ``attn_pool_*``, apply too), downloaded unless ``init_file`` is given.
            ``"videomae:<size>"`` (``vit_small`` ... ``vit_huge``): the VideoMAE network in ``init_file``
            (:func:`vitrel.from_videomae`; ``pos`` None: ``sincos1d``, their function; ``num_frames`` applies).
        init_file: a local file or folder in timm's on-disk formats holding ``init_from``'s weights
            (``.safetensors``, ``.pth``, ``.bin``, a timm / Hugging Face export folder; for ``vjepa2:``, the authors'
            checkpoint, e.g. ``vitl.pt``). With ``init_from``, a
            ``timm_kwargs`` dict in ``**kwargs`` is passed to ``timm.create_model`` (the file's architecture
            arguments, e.g. ``depth``, ``img_size``: ``+model.timm_kwargs={depth: 2}`` in ``train.py``).
        **kwargs: any other constructor argument (``depth``, ``pos_share``, ``abs_pos``...).
    """
    if init_from is not None or init_file is not None:
        return _from_timm_route(name, init_from, init_file, pos, num_classes, img_size, in_chans, kwargs)
    check_architecture(name)
    given = dict(kwargs)
    for k, v in (("pos", pos), ("num_classes", num_classes), ("img_size", img_size), ("in_chans", in_chans)):
        if v is not None:
            given[k] = v
    if checkpoint_path is not None:
        if pretrained:
            raise ValueError("give either pretrained=True (timm's route) or checkpoint_path, not both")
        return load_model(checkpoint_path, architecture=name, **given)
    return _build(name, pretrained=pretrained, **given)


#: the settings ``create_model(init_from=...)`` passes over the pretrained architecture (``vitrel.from_timm``'s)
#: the head arguments ``init_from="vjepa2:..."`` passes on (a V-JEPA 2 encoder has no head: the node's choice)
VJEPA2_HEAD_ARGS = ("global_pool", "attn_pool_type", "attn_pool_depth", "attn_pool_num_heads", "attn_pool_mlp_ratio")
TRANSFERABLE = (
    "abs_pos",
    "pos_share",
    "drop_rate",
    "pos_drop_rate",
    "proj_drop_rate",
    "attn_drop_rate",
    "drop_path_rate",
    "head_init_scale",
)


def _from_timm_route(
    name: str,
    init_from: str | None,
    init_file: str | None,
    pos: Any,
    num_classes: int | None,
    img_size: Any,
    in_chans: int | None,
    kwargs: dict[str, Any],
) -> nn.Module:
    if init_from is None:
        raise ValueError(
            "init_file needs init_from=timm:<name> (the timm architecture the file was saved from, e.g. "
            "init_from=timm:swin_tiny_patch4_window7_224) or init_from=vjepa2:<encoder> (e.g. vjepa2:vit_large)"
        )
    route, _, source = str(init_from).partition(":")
    if route not in ("timm", "vjepa2", "videomae") or not source:
        raise ValueError(
            f"init_from must be 'timm:<model name>[.<tag>]', 'vjepa2:<encoder>' ({', '.join(VJEPA2)}) or "
            f"'videomae:<size>' ({', '.join(VIDEOMAE_SIZES)}), got {init_from!r}"
        )
    kwargs, feature_args = split_feature_args(kwargs)  # (a features_only backbone: the import's)
    # timm's: its arguments; V-JEPA 2's: the clips (the data's) and the head, which its encoders do not have
    own = {"timm": ("timm_kwargs",), "vjepa2": ("num_frames", "num_segments", *VJEPA2_HEAD_ARGS)}.get(
        route, ("num_frames",)
    )
    ignored = sorted(k for k, v in kwargs.items() if k not in (*TRANSFERABLE, *own) and v is not None)
    if ignored:
        warnings.warn(
            f"init_from={init_from}: the architecture is {source}'s, so {name} and "
            f"{', '.join(f'{k}={kwargs[k]!r}' for k in ignored)} are not used",
            stacklevel=3,
        )
    extra = {k: kwargs[k] for k in (*TRANSFERABLE, *own) if kwargs.get(k) is not None}
    if route in ("vjepa2", "videomae") and in_chans not in (None, 3):  # (a video model: the weights' channels)
        raise ValueError(f"init_from={init_from}: its networks take 3 channels, not in_chans={in_chans}")
    if route == "videomae":
        if init_file is None:
            raise ValueError(
                f"init_from={init_from}: VideoMAE's checkpoints are on cloud drives, not downloadable here: give "
                "init_file=<their checkpoint.pth> (model.init_file=... in train.py)"
            )
        return from_videomae(init_file, name=source, pos=pos or "sincos1d", num_classes=num_classes,
                             img_size=img_size, **extra, **feature_args)  # fmt: skip
    if route == "vjepa2":
        return from_vjepa2(init_file, name=source, pos=pos or "rope3d_vjepa2", num_classes=num_classes or 0,
                           img_size=img_size, **extra, **feature_args)  # fmt: skip
    for k, v in (("num_classes", num_classes), ("img_size", img_size), ("in_chans", in_chans)):
        if v is not None:
            extra[k] = v
    return from_timm(source, pos=pos, checkpoint_path=init_file, **extra, **feature_args)
