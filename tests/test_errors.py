from __future__ import annotations

from dracpu.errors import ClaimError, DracpuError, KubeServerError, leaf_errors


def test_leaf_errors_flattens_nested_groups_in_order() -> None:
    first, second, third = ClaimError("a"), KubeServerError("b"), DracpuError("c")
    group = ExceptionGroup("outer", [first, ExceptionGroup("inner", [second, third])])
    assert leaf_errors(group) == [first, second, third]
