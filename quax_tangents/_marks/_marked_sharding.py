"""A marked weight made device-varying inside `shard_map`: `pvary` (which JAX binds
on a replicated operand that meets a device-varying one, and `device_varying` binds
explicitly) changes the weight's type, not its values, so it keeps the mark. Its
transpose, `psum_invariant`, then sums the compressed per-device cotangents."""

from .._core._compat import pvary_p
from .._core._registry import rule
from .._distributed._devices import vary_leaf
from ._marked import Marked


@rule(pvary_p)
def _pvary_marked(w: Marked, *, axes: tuple) -> Marked:
    return w.replace(array=vary_leaf(w.array, tuple(axes)))
