"""A marked weight under explicit mesh axes and inside `shard_map`.

- `reshard` (an FSDP all-gather before use, or a layout change that `out_sharding=`
    asks for) moves the weight and keeps its mark; its transpose retypes the
    cotangent back to the stored layout without moving the factors.
- `pvary` (which JAX binds on a replicated operand that meets a device-varying one,
    and `device_varying` binds explicitly) changes the weight's type, not its
    values, so it keeps the mark. Its transpose, `psum_invariant`, then sums the
    compressed per-device cotangents.
"""

from typing import Any

from jax.sharding import PartitionSpec

from .._core._compat import pvary_p, reshard_p
from .._core._devices import vary_leaf
from .._core._registry import rule
from ._marked import Marked


@rule(reshard_p, dense_output=True)
def _reshard_marked(w: Marked, *, dst_sharding: Any, **params: Any) -> Any:
    if w.view is not None:
        return Marked.default(
            reshard_p, (w,), dict(dst_sharding=dst_sharding, **params)
        )
    spec = tuple(dst_sharding.spec) + (None,) * (w.ndim - len(dst_sharding.spec))
    if w.transposed:  # the spec is of the weight as seen: swap its matrix dims
        spec = spec[:-2] + spec[-2:][::-1]
    stored = dst_sharding.update(spec=PartitionSpec(*spec))
    return w.replace(array=reshard_p.bind(w.array, dst_sharding=stored, **params))


@rule(pvary_p)
def _pvary_marked(w: Marked, *, axes: tuple) -> Marked:
    return w.replace(array=vary_leaf(w.array, tuple(axes)))
