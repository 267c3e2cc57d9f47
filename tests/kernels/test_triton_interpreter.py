"""tests/triton_interpreter.py: the interpreter's shim (installed by tests/conftest.py) runs a kernel whose program
calls ``@triton.jit`` helpers to the same values as the interpreter alone, patching the language once a launch; its
options without ``sanitize_overflow`` lose no check (with ``debug`` off an overflow is never reported)."""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter only")

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")


@triton.jit
def _scaled(x, s):
    return x * s + tl.exp(x)


@triton.jit
def _kernel(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n, other=0.0)
    for i in range(3):  # a helper called several times in each program
        x = _scaled(x, 0.5 + i)
    tl.store(out_ptr + offs, x, mask=offs < n)


def _run(x: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    _kernel[(triton.cdiv(x.numel(), 8),)](x, out, x.numel(), BLOCK=8)
    return out


def test_shim_runs_helpers_to_the_interpreters_values_patching_once_a_launch(monkeypatch):
    from triton.runtime import interpreter

    from tests.triton_interpreter import shim_over, skip_repeated_patching

    assert skip_repeated_patching() and interpreter._patch_lang.__module__ == "tests.triton_interpreter"
    original, calls = interpreter._patch_lang.original, []

    def counting(fn):
        calls.append(fn.__name__)
        return original(fn)

    x = torch.linspace(-1, 1, 37, dtype=torch.float64)  # 5 programs of 8
    expected = x.clone()
    for i in range(3):
        expected = expected * (0.5 + i) + expected.exp()
    monkeypatch.setattr(interpreter, "_patch_lang", counting)  # the interpreter alone
    alone = _run(x)
    assert calls == ["_kernel"] + ["_scaled"] * 15
    calls.clear()
    monkeypatch.setattr(interpreter, "_patch_lang", shim_over(counting, interpreter._LangPatchScope))
    shimmed = _run(x)
    assert calls == ["_kernel"], calls  # the 15 helper calls patch nothing
    torch.testing.assert_close(alone, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(shimmed, alone)
    calls.clear()
    assert torch.equal(_run(x), alone) and calls == ["_kernel"]  # the next launch patches again


@triton.jit
def _twice(x_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(x_ptr + offs, mask=offs < n)
    tl.store(out_ptr + offs, x + x, mask=offs < n)  # (int32: overflows for |x| >= 2**30)


def test_overflow_checks_are_off_only_where_debug_drops_them(monkeypatch):
    """The interpreter's own options (``debug`` off, ``sanitize_overflow`` on) run an int32 add that overflows without
    a word, to the wrapped values the options of the shim give: the overflow check was never made. With ``debug`` on
    it is made (an error), and the shim leaves such options as they are."""
    import dataclasses

    from triton.runtime import interpreter

    from tests.triton_interpreter import skip_discarded_overflow_checks, without_discarded_checks

    builder = interpreter.interpreter_builder
    assert not builder.options.sanitize_overflow  # (installed by tests/conftest.py)
    assert skip_discarded_overflow_checks() and not builder.options.sanitize_overflow  # (again: the same)
    stock = interpreter.InterpreterOptions()
    assert stock.sanitize_overflow and not stock.debug
    x = torch.tensor([1, 2**31 - 1, -(2**31), 5], dtype=torch.int32)

    def twice(options) -> torch.Tensor:
        monkeypatch.setattr(builder, "options", options)
        out = torch.empty_like(x)
        _twice[(1,)](x, out, 4, BLOCK=4)
        return out

    assert twice(stock).tolist() == twice(without_discarded_checks(stock)).tolist() == [2, -2, 0, 10]
    debug = dataclasses.replace(stock, debug=True)
    assert without_discarded_checks(debug) is debug
    with pytest.raises(Exception, match="int32 overflow detected for operation add"):
        twice(debug)
