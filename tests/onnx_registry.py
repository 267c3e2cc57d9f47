"""``torch.onnx.export`` without the registry it builds again at every call.

Each ``torch.onnx.export(..., dynamo=True)`` builds its operator registry from torchlib (``ONNXRegistry.from_torchlib``:
an overload lookup for each of its functions), the same registry at every call for one opset: about 1 s of each ONNX
case of tests/models/test_export.py (5 to 20 s each in the suite), 41 cases in the default suite.

:func:`share_torchlib_registry` builds it once per opset and hands each call a copy of its own (its own dict and
lists, so a ``custom_translation_table`` registered into one call's registry does not reach the next); the export
converts with the same functions. tests/models/test_export.py installs it for its module.
"""

from __future__ import annotations

from typing import Any


def copy_registry(registry: Any) -> Any:
    """A registry of the same class, opset and functions, whose dict and lists are its own."""
    new = type(registry)()
    new._opset_version = registry._opset_version
    new.functions = {k: list(v) for k, v in registry.functions.items()}
    return new


def shared_from_torchlib(original) -> classmethod:
    """``ONNXRegistry.from_torchlib`` built once per (class, opset); each call returns a copy
    (:func:`copy_registry`)."""
    built: dict[tuple[type, int], Any] = {}

    def from_torchlib(cls, opset_version=None):
        key = (cls, opset_version)
        if key not in built:
            built[key] = original(cls) if opset_version is None else original(cls, opset_version=opset_version)
        return copy_registry(built[key])

    from_torchlib.original = original
    return classmethod(from_torchlib)


def share_torchlib_registry(monkeypatch) -> None:
    """Install :func:`shared_from_torchlib` over torch's ``ONNXRegistry.from_torchlib`` (undone with ``monkeypatch``).
    Raises where this torch has no such method (rather than running at its own speed without a word)."""
    from torch.onnx._internal.exporter._registration import ONNXRegistry

    original = ONNXRegistry.__dict__["from_torchlib"].__func__
    monkeypatch.setattr(ONNXRegistry, "from_torchlib", shared_from_torchlib(original))
