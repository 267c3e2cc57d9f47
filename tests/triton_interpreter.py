"""Triton's interpreter (``TRITON_INTERPRET=1``, the kernels' tests on a machine without a GPU), without the work it
repeats at every call of a ``@triton.jit`` helper, and without the overflow checks it computes and then discards.

A launch patches ``triton.language``'s builtins to their interpreted forms for its duration; Triton 3.8 then patches
them again at every call of a jitted helper inside the kernel (``InterpretedFunction.__call__`` -> ``_patch_lang``:
``inspect.getmembers`` over the language modules, per program instance and call), and never undoes those
patches. In the fused kernels, whose tiles call helpers, that was about 40 % of the interpreter's time
(``tests/kernels/test_triton_bias.py -k "equals_reference or tiles_not_square"``: 62 s -> 39 s, one process).

:func:`skip_repeated_patching` makes a helper's call skip the patching when the running launch already patched
every language module the helper sees (the same module objects: what it would patch is what is patched); a launch,
and a helper that sees another language module, patch as before. The kernels run the same interpreted code. Which
language modules a helper sees is looked up once a helper (again when its module's globals change in number), not at
every call: that lookup over the module's globals was 6-10 % of the interpreter's time.

The interpreter's options also have ``sanitize_overflow`` on and ``debug`` off: at every integer ``+``, ``-``, ``*`` of
a kernel, Triton computes the operation again in int64 and its comparison with the int32 range, then hands that to
``device_assert``, which with ``debug`` off returns without asserting. No overflow is ever reported; the work is
discarded (``tests/kernels/test_triton_bias.py``: 185 s, 157 s -> 110 s, 104 s, one process).
:func:`skip_discarded_overflow_checks` turns ``sanitize_overflow`` off where ``debug`` is off, so no assertion is lost
(with ``debug`` on it is left on).
"""

from __future__ import annotations

import dataclasses
import inspect
import warnings

_INSTALLED = False


def shim_over(original, scope_cls):
    """``original`` (Triton's ``_patch_lang(fn) -> scope``) that a helper's call inside a launch skips (an empty
    ``scope_cls()``) when the launch patched every language module the helper sees."""
    langs_of_launch: list[set[int]] = []  # the language modules the running launch patched (ids)
    seen: dict = {}  # fn -> (how many globals it had, the language modules among them): looked at again if that changes

    def langs_of(fn) -> frozenset[int]:
        names = fn.__globals__
        known = seen.get(fn)
        if known is None or known[0] != len(names):
            from triton.runtime.interpreter import tl

            langs = frozenset(id(v) for v in names.values() if inspect.ismodule(v) and v in (tl, tl.core))
            known = seen[fn] = (len(names), langs)
        return known[1]

    def patch_lang(fn):
        langs = langs_of(fn)
        if langs_of_launch and langs <= langs_of_launch[0]:
            return scope_cls()  # a helper inside the launch: nothing left to patch
        scope = original(fn)
        if langs_of_launch:
            langs_of_launch[0] |= langs
            return scope
        langs_of_launch.append(set(langs))
        restore = scope.restore

        def restore_launch() -> None:
            langs_of_launch.clear()
            restore()

        scope.restore = restore_launch
        return scope

    return patch_lang


def skip_repeated_patching() -> bool:
    """Install :func:`shim_over` Triton's ``triton.runtime.interpreter._patch_lang`` (once); False, with a warning,
    where this Triton's interpreter has none (the tests then run at the interpreter's own speed)."""
    global _INSTALLED
    if _INSTALLED:
        return True
    from triton.runtime import interpreter

    original = getattr(interpreter, "_patch_lang", None)
    scope_cls = getattr(interpreter, "_LangPatchScope", None)
    if original is None or scope_cls is None:
        warnings.warn("this Triton's interpreter has no _patch_lang: shim not installed", stacklevel=2)
        return False
    interpreter._patch_lang = shim_over(original, scope_cls)
    interpreter._patch_lang.original = original
    _INSTALLED = True
    return True


def without_discarded_checks(options):
    """``options`` (the interpreter's) with ``sanitize_overflow`` off if ``debug`` is off (then ``device_assert`` drops
    the overflow checks it makes); else ``options`` as they are."""
    return options if options.debug else dataclasses.replace(options, sanitize_overflow=False)


def skip_discarded_overflow_checks() -> bool:
    """The interpreter's builder (one for every launch) with :func:`without_discarded_checks`'s options; False, with a
    warning, where this Triton's interpreter has no such options (the tests then run at the interpreter's speed)."""
    from triton.runtime import interpreter

    builder = getattr(interpreter, "interpreter_builder", None)
    options = getattr(builder, "options", None)
    if not (hasattr(options, "sanitize_overflow") and hasattr(options, "debug")):
        warnings.warn("this Triton's interpreter has no sanitize_overflow option: left as it is", stacklevel=2)
        return False
    builder.options = without_discarded_checks(options)
    return True
