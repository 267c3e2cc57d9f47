"""The scheme registry and the one parser of a position spec.

A position spec is what a user writes: a registered name (``pos=rel2d_factored``), a config mapping
(``{"name": "rope2d_mixed", "theta": 100}``, a Hydra ``DictConfig`` included) or None (no position).
:func:`parse_pos` resolves it once into a :class:`PosSpec`, the scheme class and its checked options;
the model builds its schemes from it (``spec.build(num_heads=..., ..., layer=(i, depth))``, what timm's
``rel_pos_cls`` partials do) and stores ``spec.plain`` in its configuration to be rebuilt from a checkpoint.
"""

from __future__ import annotations

import collections.abc
import inspect
import types
import typing
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from vitrel.pos.base import PositionScheme
from vitrel.pos.init_stream import own_stream

__all__ = [
    "PosArg",
    "PosSpec",
    "UnknownSchemeError",
    "build_pos",
    "get_pos_class",
    "image_scheme",
    "list_pos",
    "parse_pos",
    "register_pos",
    "scheme_options",
    "split_pos",
]


class UnknownSchemeError(ValueError):
    """A position scheme name that is not registered."""


_REGISTRY: dict[str, type[PositionScheme]] = {}

#: What a user writes for a scheme: a registered name, a config mapping with ``name`` (options beside it), or
#: None (no position). :func:`parse_pos` turns it into a :class:`PosSpec`.
PosArg = str | Mapping[str, Any] | None

#: The sizes every scheme gets from its model (not options of a spec).
SIZES = ("num_heads", "head_dim", "grid", "num_prefix_tokens", "embed_dim")


#: Each hook and the declaration the kernels read before calling it (a hook without its declaration is never called
#: by some of them: a ``bias`` without ``has_bias`` is dropped by flex, triton and packed batches, kept by sdpa).
HOOK_FLAGS = {
    "bias": "has_bias",
    "offset_table": "has_offset_table",
    "bias_factors": "has_bias_factors",
    "rotation": "has_rotation",
    "rotate": "has_rotation",
    "content_logits": "has_content_terms",
    "content_values": "has_content_terms",
    "content_key_logits": "has_content_terms",
    "augment": "has_token_terms",
    "mix": "mixes_weights",
}


def check_declarations(cls: type[PositionScheme]) -> None:
    """Refuse a scheme class whose hooks and declared capabilities disagree (:data:`HOOK_FLAGS`; ``add_to_tokens`` is
    for ``kind = 'absolute'``), naming the line to add."""
    defined = {h for h in (*HOOK_FLAGS, "add_to_tokens", "add_to_layout") if cls.defines(h)}
    for hook, flag in HOOK_FLAGS.items():
        if hook in defined and not getattr(cls, flag):
            raise TypeError(
                f"{cls.__name__} defines {hook}() but declares {flag} = False: set {flag} = True in the class, or "
                "the kernels that read the declaration never call it"
            )
    for flag in dict.fromkeys(HOOK_FLAGS.values()):
        hooks = [h for h, f in HOOK_FLAGS.items() if f == flag]
        if getattr(cls, flag) and not defined & set(hooks):
            raise TypeError(f"{cls.__name__} declares {flag} = True but defines no {' / '.join(hooks)}()")
    for flag in ("has_offset_table", "has_bias_factors"):  # forms of the bias: a kernel reads them for has_bias only
        if getattr(cls, flag) and not cls.has_bias:
            hook = next(h for h, f in HOOK_FLAGS.items() if f == flag)
            raise TypeError(
                f"{cls.__name__} declares {flag} = True but has_bias = False: {hook}() is a faster form of the bias, "
                "which the kernels read only for a scheme with a bias: define bias() (the dense [heads, N, N] terms) "
                "and set has_bias = True"
            )
    for hook in ("add_to_tokens", "add_to_layout"):
        if hook in defined and cls.kind != "absolute":
            raise TypeError(
                f"{cls.__name__} defines {hook}() (an embedding added to the tokens) but is kind = {cls.kind!r}: "
                "set kind = 'absolute'"
            )
    if cls.embeds_content and "add_to_layout" not in defined:
        raise TypeError(
            f"{cls.__name__} declares embeds_content = True (its embedding reads the tokens) but keeps the default "
            "add_to_layout(), which adds the embedding of zeros: define add_to_layout() for packed and dropped tokens"
        )


def register_pos(name: str) -> Callable[[type[PositionScheme]], type[PositionScheme]]:
    """Class decorator: make a scheme buildable as ``pos=name``. The class's hooks must match its declared
    capabilities (:func:`check_declarations`)."""

    def deco(cls: type[PositionScheme]) -> type[PositionScheme]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            had = _REGISTRY[name]
            where = f"{had.__module__}.{had.__qualname__}"
            why = (
                "a class of that name defined again (a notebook cell run twice): restart the kernel, or name it anew"
                if had.__module__ == cls.__module__ and had.__qualname__ == cls.__qualname__
                else "choose another name"
            )
            raise ValueError(f"position scheme {name!r} is registered twice: {where} has it; {why}")
        check_declarations(cls)
        _REGISTRY[name] = cls
        cls.name = name
        return cls

    return deco


def list_pos(kind: str | None = None) -> list[str]:
    """Names of all registered schemes (optionally only ``"relative"`` or ``"absolute"`` ones)."""
    return sorted(n for n, c in _REGISTRY.items() if kind is None or c.kind == kind)


def get_pos_class(name: str) -> type[PositionScheme]:
    if name not in _REGISTRY:
        raise UnknownSchemeError(
            f"unknown position scheme {name!r}; known schemes: {', '.join(list_pos())}. A scheme registered outside "
            "vitrel is known once the module that registers it is imported (docs/schemes.md: Adding a position scheme)"
        )
    return _REGISTRY[name]


def image_scheme(cls: type[PositionScheme]) -> str | None:
    """The registered image scheme that a video scheme (``grid_dims == 3``) is on one frame: its name with ``3d`` read
    as ``2d`` (``rel3d_factored`` -> ``rel2d_factored``, ``rope3d_mixed`` -> ``rope2d_mixed``, ``sincos3d`` ->
    ``sincos2d``); None when no such scheme is registered."""
    name = cls.name.replace("3d", "2d")
    return name if name != cls.name and name in _REGISTRY and _REGISTRY[name].grid_dims == 2 else None


def scheme_options(cls: type[PositionScheme]) -> set[str]:
    """The keyword options a scheme class takes (its constructors' along the MRO, minus the sizes every
    scheme gets from the model and the per-layer arguments)."""
    names: set[str] = set()
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is nn.Module or klass is object:
            continue
        for p in inspect.signature(init).parameters.values():
            if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name != "self":
                names.add(p.name)
    return (names | set(cls.renamed_options)) - set(SIZES) - {"layer"}


@dataclass(frozen=True)
class PosSpec:
    """A position spec resolved once: the scheme class and its (checked) options.

    ``plain`` is the JSON-able form it was given in (a name, or a dict with ``name``), what a model stores.
    """

    cls: type[PositionScheme]
    options: Mapping[str, Any] = field(default_factory=dict)
    plain: str | dict[str, Any] = "none"

    @property
    def name(self) -> str:
        return self.cls.name

    @property
    def kind(self) -> str:
        return self.cls.kind

    def build(self, *, causal: bool | None = None, **sizes: Any) -> PositionScheme:
        """The scheme for ``sizes``, keywords of :class:`~vitrel.pos.base.PositionScheme`'s constructor (which declares
        them and their defaults): ``num_heads``, ``head_dim``, ``grid``, ``num_prefix_tokens``, ``embed_dim`` and
        ``layer``, ``(index, number of layers)`` of the block it serves (per-layer schedules). ``causal``: given to a
        ``causal_aware`` scheme whose spec does not set it. The scheme draws its initial values from a stream of its
        own (:func:`~vitrel.pos.init_stream.own_stream`): torch's global generators are left as they were, so the
        layers a model builds around its schemes start alike whatever the scheme."""
        unknown = sorted(set(sizes) - {*SIZES, "layer"})
        if unknown:
            raise TypeError(f"PosSpec.build takes the sizes {SIZES} and 'layer', got {unknown}")
        kwargs = dict(self.options)
        if causal is not None and self.cls.causal_aware:
            kwargs.setdefault("causal", causal)
        # (an absolute and a relative scheme built in a row draw apart; one scheme's variants, and a video scheme and
        # its image one, draw alike)
        salt = f"{self.kind} {sizes.get('layer')}"
        with own_stream(salt):
            scheme = self.cls(**sizes, **kwargs)
        _check_registered_tensors(scheme)
        key = (self.cls, repr(sorted(kwargs.items())))
        if key not in _UNSAVED_CHECKED and _unsaved_buffers(scheme):  # (once a class and options: a second build)
            with own_stream(salt + " drawn again"):
                _check_unsaved_buffers(scheme, self.cls(**sizes, **kwargs))
            _UNSAVED_CHECKED.add(key)
        return scheme


#: the scheme classes (and options) whose non-persistent buffers :func:`_check_unsaved_buffers` found the same over
#: two draws
_UNSAVED_CHECKED: set[tuple[type[PositionScheme], str]] = set()


def _check_registered_tensors(scheme: PositionScheme) -> None:
    """A tensor kept as a plain attribute of a scheme (``self.w = torch.randn(...)``) is neither saved with the
    weights (a reload draws it anew: another model) nor moved by ``.to()``: a ``TypeError`` naming the fix."""
    for name, mod in scheme.named_modules():
        plain = [k for k, v in vars(mod).items() if isinstance(v, Tensor)]
        if plain:
            where = ", ".join(f"self.{k}" for k in plain) + (f" (in {name})" if name else "")
            raise TypeError(
                f"{type(scheme).__name__}: {where} is a tensor kept as a plain attribute, which is not saved with the "
                "weights nor moved by .to(): make it an nn.Parameter (learned) or register_buffer(...) (fixed)"
            )


def _unsaved_buffers(scheme: nn.Module) -> dict[str, Tensor]:
    """``scheme``'s buffers that its state dict leaves out (``persistent=False``), on a device with values."""
    saved = scheme.state_dict(keep_vars=True)
    return {k: b for k, b in scheme.named_buffers() if k not in saved and b.device.type != "meta"}


def _check_unsaved_buffers(scheme: PositionScheme, again: PositionScheme) -> None:
    """A buffer left out of the state dict is made anew at each load: one drawn at random (two builds from two
    streams differ) makes another model from the same weights. A ``TypeError`` naming the fix."""
    other = _unsaved_buffers(again)
    drawn = [k for k, b in _unsaved_buffers(scheme).items() if not torch.equal(b, other[k]) and not b.isnan().any()]
    if drawn:
        where = ", ".join(drawn)
        raise TypeError(
            f"{type(scheme).__name__}: buffer {where} is drawn at random but registered with persistent=False: it is "
            "not saved with the weights, so a reload draws it anew (another model); register it persistent (the "
            "default) or make it an nn.Parameter"
        )


def parse_pos(pos: Any, **options: Any) -> PosSpec | None:
    """A name, a config mapping (``name`` plus the scheme's options) or a ``PosSpec`` -> ``PosSpec``; None
    stays None. ``options``: more options as keywords. Unknown names and options are refused here, with the
    scheme's options listed."""
    if options:
        if pos is None or isinstance(pos, PositionScheme):
            raise ValueError(f"scheme options {sorted(options)} given without a scheme name")
        pos = {**({"name": pos} if isinstance(pos, str) else dict(pos.items())), **options}
    if pos is None or isinstance(pos, PosSpec):
        return pos
    if isinstance(pos, PositionScheme):
        raise TypeError(
            "models take a position scheme by name or config dict (so they can be rebuilt from a checkpoint), "
            f"not a module; got {type(pos).__name__}"
        )
    if isinstance(pos, str):
        return PosSpec(get_pos_class(pos), {}, pos)
    if not hasattr(pos, "items"):
        raise TypeError(f"pos must be a scheme name or a config dict, got {type(pos).__name__}")
    plain = {str(k): _plain(v) for k, v in pos.items()}
    options = dict(plain)
    name = options.pop("name", None)
    if name is None:
        raise ValueError(f"a position config needs a 'name' key, got {plain}")
    cls = get_pos_class(name)
    unknown = sorted(set(options) - scheme_options(cls))
    if unknown:
        raise ValueError(
            f"position scheme {name!r} has no option(s) {unknown}; its options: {sorted(scheme_options(cls))}"
        )
    _check_option_types(cls, options)
    return PosSpec(cls, options, plain)


def option_types(cls: type[PositionScheme]) -> dict[str, Any]:
    """The annotated type of each keyword option of a scheme class, from the first constructor along its MRO
    that takes it (options without an annotation, or one that cannot be resolved, are left out)."""
    types: dict[str, Any] = {}
    for klass in cls.__mro__:
        init = klass.__dict__.get("__init__")
        if init is None or klass is nn.Module or klass is object:
            continue
        try:
            params = inspect.signature(init, eval_str=True).parameters
        except (NameError, TypeError, SyntaxError):  # an annotation that names what the module does not import
            continue
        for p in params.values():
            if p.annotation is not p.empty and p.name not in types:
                types[p.name] = p.annotation
    return types


def _check_option_types(cls: type[PositionScheme], options: Mapping[str, Any]) -> None:
    """Refuse an option whose value does not have the type its constructor declares (``rotate: "false"``, a string,
    would otherwise be read as true; ``base: "ten"`` fail deep in a float conversion), naming the option and the value.
    A string for a number is refused too (YAML's ``"32"``); an int is a float."""
    declared = option_types(cls)
    for key, value in options.items():
        ann = declared.get(key)
        if ann is not None and not _matches(value, ann):
            raise ValueError(
                f"position scheme {cls.name!r}: option {key} must be {_describe(ann)}, got {value!r} "
                f"({type(value).__name__})"
            )


_SIMPLE = {bool: "true or false", int: "an integer", float: "a number", str: "a string", type(None): "null"}


def _matches(value: Any, ann: Any) -> bool:
    """Whether ``value`` (plain: dicts, lists, scalars) has the type ``ann``; types other than the simple ones, unions
    and lists / tuples / sequences of them are not checked here (the constructor checks them)."""
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return any(_matches(value, a) for a in args)
    if ann is bool:
        return isinstance(value, bool)
    if ann is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if ann is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if ann is str or ann is type(None):
        return isinstance(value, ann)
    if ann is dict or origin is dict:
        return isinstance(value, Mapping)
    if origin in (list, tuple, Sequence, collections.abc.Sequence):
        if isinstance(value, str) or not isinstance(value, (list, tuple)):
            return False
        if origin is tuple and args and args[-1] is not Ellipsis:
            return len(value) == len(args) and all(_matches(v, a) for v, a in zip(value, args))
        return not args or all(_matches(v, args[0]) for v in value)
    return True


def _describe(ann: Any) -> str:
    origin, args = typing.get_origin(ann), typing.get_args(ann)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(_describe(a) for a in args)
    if ann in _SIMPLE:
        return _SIMPLE[ann]
    if ann is dict or origin is dict:
        return "a mapping"
    if origin in (list, tuple, Sequence, collections.abc.Sequence):
        short = {bool: "bool", int: "int", float: "number", str: "string"}
        items = [short.get(a, getattr(a, "__name__", str(a))) for a in args if a is not Ellipsis]
        if origin is tuple and args and args[-1] is not Ellipsis:
            return f"a list [{', '.join(items)}]"
        return f"a list [{items[0]}, ...]" if items else "a list"
    return getattr(ann, "__name__", str(ann))


def _plain(v: Any) -> Any:
    """Hydra containers -> plain dicts and lists."""
    if hasattr(v, "items"):
        return {str(k): _plain(x) for k, x in v.items()}
    if isinstance(v, (list, tuple)) or (hasattr(v, "__iter__") and type(v).__name__ == "ListConfig"):
        return [_plain(x) for x in v]
    return v


def split_pos(pos: PosSpec | None, abs_pos: PosSpec | None) -> tuple[PosSpec, PosSpec | None]:
    """Resolve a model's ``(pos, abs_pos)`` into ``(relative scheme, absolute scheme or None)``.

    ``pos`` may name any scheme: an absolute one (``pos="ape"``) means that absolute embedding and no
    relative scheme. ``abs_pos`` adds an absolute scheme to a relative one (``pos="rel2d_full",
    abs_pos="ape"``).
    """
    if abs_pos is not None and abs_pos.kind != "absolute":
        raise ValueError(f"abs_pos must be an absolute scheme, {abs_pos.name!r} is relative")
    if pos is not None and pos.kind == "absolute":
        if abs_pos is not None:
            raise ValueError(
                f"pos={pos.name!r} is already an absolute scheme; abs_pos={abs_pos.name!r} would add a second"
            )
        return parse_pos("none"), pos
    return (pos if pos is not None else parse_pos("none")), abs_pos


def build_pos(pos: Any, **kwargs: Any) -> PositionScheme:
    """``parse_pos(pos).build(...)``: ``kwargs`` holds :meth:`PosSpec.build`'s sizes (``num_heads``, ``head_dim``,
    ``grid``, ``num_prefix_tokens``, ``embed_dim``) and ``layer``; any other keyword is an option of the scheme
    (``build_pos("rope1d", ..., base=10.0)`` is ``build_pos({"name": "rope1d", "base": 10.0}, ...)``). None is no
    position; a ``PositionScheme`` passes through.

    ``grid`` is the grid the scheme is built for (it sizes learned tables); every scheme still runs on any
    grid at call time.
    """
    sizes = {k: kwargs.pop(k) for k in (*SIZES, "layer") if k in kwargs}
    if isinstance(pos, PositionScheme):
        if kwargs:
            raise ValueError(f"options {sorted(kwargs)} given with a built scheme ({pos.name})")
        return pos
    return parse_pos("none" if pos is None else pos, **kwargs).build(**sizes)
