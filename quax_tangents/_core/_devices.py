"""Named-axis helpers shared by the types' collective methods and `_collective.py`.

They run inside the body of `jax.shard_map` (or anything else that binds a named
axis) on plain arrays, and import no compressed type, so every type module can use
them.
"""

import math
from collections.abc import Callable, Hashable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, PyTree

from ._compat import check_vma_enabled, psum_invariant_p
from ._fallback import record_densification
from ._guard import is_guard


AxisName = Hashable | tuple[Hashable, ...]


def axes_of(axis_name: AxisName) -> tuple[Hashable, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_is_bound(axis_name: AxisName) -> bool:
    """Whether every named axis is bound here (inside `shard_map`, `vmap` etc.)."""
    try:
        for axis in axes_of(axis_name):
            lax.axis_size(axis)
    except NameError:
        return False
    return True


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along `axis_name` (the product for a tuple of axes)."""
    return math.prod(lax.axis_size(a) for a in axes_of(axis_name))


def vary_leaf(x: Any, axes: tuple[Hashable, ...]) -> Any:
    x = jnp.asarray(x)
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def varying_alike(*arrays: Any) -> list[Any]:
    """`arrays`, each cast varying over every mesh axis that any of them varies over
    (`pvary`), as JAX's own `lax.add` and friends cast before binding: a primitive
    bound directly on a device-varying array and a replicated one is refused under
    `check_vma` (inside `jax.shard_map`). Unchanged where none varies."""
    varying = set()
    for x in arrays:
        varying.update(getattr(getattr(jax.typeof(x), "mat", None), "varying", ()))
    if not varying:
        return list(arrays)
    axes = tuple(sorted(varying, key=str))
    return [vary_leaf(x, axes) for x in arrays]


def device_varying(tree: PyTree, axis_name: AxisName) -> PyTree:
    """Marks every array of `tree` as varying over `axis_name` (`lax.pcast(...,
    to="varying")`, that is `pvary`), leaving arrays that already vary unchanged.

    Differentiate with respect to `device_varying(params, axis_name)` inside a
    `shard_map` body to get each device's own gradient of a replicated weight. Without
    it, JAX's AD inserts a dense all-reduce of the weight's gradient (the transpose of
    the implicit `pvary` of the weight) before any compressor sees the gradient. With
    `check_vma=False` nothing is typed and this returns `tree` unchanged.

    **Arguments:**

    - `tree`: a pytree of arrays or compressed values.
    - `axis_name`: a mesh axis name, or a tuple of them.

    **Returns:**

    The same values, typed as varying over `axis_name`.
    """
    axes = axes_of(axis_name)
    # A compressed value's guard leaf is a constant that holds no data: it stays
    # replicated, so that `partition_specs` can give it `P()`.
    return jtu.tree_map(lambda x: x if is_guard(x) else vary_leaf(x, axes), tree)


def invariant_over(x: Any, axis_name: AxisName) -> bool:
    """Whether JAX's types say `x` is the same on every device along `axis_name`:
    under `shard_map(..., check_vma=True)`, `x` does not vary over any of its axes.
    Without `check_vma` nothing is known, and this is `False`."""
    if not check_vma_enabled():
        return False
    varying = getattr(getattr(jax.typeof(x), "mat", None), "varying", None)
    if varying is None:
        return False
    return not set(axes_of(axis_name)) & set(varying)


def shared_factor(x: Any, axis_name: AxisName) -> str | None:
    """`"left"` or `"right"`: the factor of a `LowRank` (fields `left`, `right`) that
    is the same on every device along `axis_name`, so that the sum over devices is
    that factor times the sum of the other; `None` when neither is known to be."""
    if invariant_over(x.left, axis_name):
        return "left"
    if invariant_over(x.right, axis_name):
        return "right"
    return None


def gather(x: Array, axis_name: AxisName) -> Array:
    """Every device's `x`, stacked on a new leading axis, identical on every device.

    The input is made varying first, so that an input that is already replicated is
    gathered rather than rejected under `check_vma=True`.
    """
    return lax.all_gather(
        vary_leaf(x, axes_of(axis_name)), axis_name, axis=0, to="invarying"
    )


def gather_along(x: Array, axis_name: AxisName, *, axis: int) -> Array:
    """Every device's `x` concatenated along `axis` (device-major within it)."""
    gathered = gather(x, axis_name)
    moved = jnp.moveaxis(gathered, 0, axis - 1 if axis < 0 else axis)
    shape = list(gathered.shape[1:])
    shape[axis] *= gathered.shape[0]
    return moved.reshape(shape)


def dense_all_reduce(x: Array, axis_name: AxisName, *, mean: bool = False) -> Array:
    """`lax.psum` (or `pmean`) of a dense array, made varying first."""
    x = vary_leaf(x, axes_of(axis_name))
    return lax.pmean(x, axis_name) if mean else lax.psum(x, axis_name)


def gathered_or_dense_sum(
    value: Any,
    axes: tuple[Hashable, ...],
    gather_is_cheaper: Callable[[int], bool],
    gathered: str,
    why_dense: str = "",
) -> Any:
    """The sum over devices of a compressed `value` that stores entries (rows,
    elements): its `all_reduce`, every device's entries side by side, exact, while
    `gather_is_cheaper(devices)`; otherwise the dense sum, exact and counted (the
    `psum_invariant` that `lax.psum` binds). `gathered` names what would be
    gathered and `why_dense` says why the dense sum is cheaper, for the message."""
    devices = axis_size(axes)
    if devices == 1 or gather_is_cheaper(devices):
        return value.all_reduce(axes)
    total = dense_all_reduce(value.materialise(), axes)
    record_densification(
        psum_invariant_p.name,
        (type(value).__name__,),
        f"gathering {devices} devices' {gathered} would receive more than a dense "
        "all-reduce of it",
        f"The dense sum is the cheaper exact one here{why_dense}; hide this with "
        "`quax_tangents.fallback('silent')`.",
    )
    return total
