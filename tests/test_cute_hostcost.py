"""``cute_moe.lab.hostcost`` times fused_moe's steps by wrapping module globals by name: each must exist
and be called where fused_moe's layer runs, or the split silently loses a step (a renamed global made
every cell an AttributeError on the device)."""

from __future__ import annotations

import inspect

import pytest

pytest.importorskip("cutlass")

from cute_moe.lab.hostcost import WRAPPED, wrapped_modules  # noqa: E402


@pytest.mark.parametrize("column, module, name", WRAPPED)
def test_each_wrapped_step_is_a_global_the_layer_calls(column, module, name):
    mod = wrapped_modules()[module]
    assert callable(getattr(mod, name, None)), f"{column}: cute_moe.{module} has no global {name}"
    assert f"{name}(" in inspect.getsource(mod), f"{column}: cute_moe.{module} never calls {name}"
