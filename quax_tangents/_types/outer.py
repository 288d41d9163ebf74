"""`OuterSum`: a weight gradient `X^T C` kept as its two factors while the backward
pass accumulates it.

It exists only between the `dot_general`s where a marked weight is used (see
`quax_tangents._marks._cotangents`) and the point where the weight's total cotangent is
finished into its final form (a `LowRank` under the rank budget, or a projection).
Unlike `LowRank` it has no rank budget: its rank is the number of rows contracted
(batch times sequence), often larger than the matrix's sides, and that is fine for
the few products the finishing step takes of it.

Every rule this representation registers lives in this file.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec
from jaxtyping import Array, ArrayLike, Float

from .._core._base import CompressedArray, densify
from .._core._compat import psum_invariant_p, reshard_p
from .._core._devices import axis_size, dense_all_reduce, gather_along
from .._core._fallback import record_densification
from .._core._lax import add_any_p
from .._core._registry import rule
from .._core._sharding import (
    explicit_axes,
    factored_type,
    spec_entries,
    typed_as,
)


class OuterSum(CompressedArray):
    """The matrix `left @ right.T` of shape `(*batch, m, n)`, a sum of `B` outer
    products per batch element.

    **Arguments:**

    - `left`: floating array `(*batch, m, B)`.
    - `right`: floating array `(*batch, n, B)` of the same dtype and leading dims.
    - `spec`: under explicit mesh axes, the sharding `(rows, cols)` of the matrix
        dims (the weight's, whose cotangent it is), or `None` for the one its
        factors imply; the batch dims are sharded as the factors' are. The factors'
        `B` dim is often sharded (the batch, on a data axis), so the product is a
        sum over devices that no sharding of the factors alone types as the weight
        is. Only the matrix dims are kept, so that stacking (a scan's outputs)
        leaves it valid.
    """

    left: Float[Array, "*batch m B"]
    right: Float[Array, "*batch n B"]
    spec: Any = eqx.field(static=True, default=None)

    @property
    def batch_ndim(self) -> int:
        return self.left.ndim - 2

    def aval(self) -> jax.core.ShapedArray:
        shape = self.left.shape[:-1] + self.right.shape[-2:-1]
        typed = factored_type(shape, self.left.dtype, self.left, self.right)
        return typed_as(typed, self._full_spec())

    def _full_spec(self) -> PartitionSpec | None:
        if self.spec is None:
            return None
        return PartitionSpec(*spec_entries(self.left)[:-2], *self.spec)

    def materialise(self) -> Array:
        right_t = jnp.swapaxes(self.right, -1, -2)
        if self.spec is None or not explicit_axes():
            return jnp.matmul(self.left, right_t)
        return jnp.matmul(self.left, right_t, out_sharding=self._full_spec())


@rule(add_any_p)
def _add_any(x: OuterSum, y: OuterSum) -> OuterSum | Array:
    if (x.shape, x.dtype) != (y.shape, y.dtype):
        return densify(add_any_p, [x, y], {}, reason="shapes or dtypes differ")
    left = jnp.concatenate([x.left, y.left], axis=-1)
    return OuterSum(left, jnp.concatenate([x.right, y.right], axis=-1), x.spec)


def _plus_dense(x: OuterSum, y: ArrayLike) -> Array:
    if x.shape != jnp.shape(y) or x.dtype != jnp.result_type(y):
        return densify(add_any_p, [x, y], {}, reason="shapes or dtypes differ")
    record_densification(add_any_p.name, ("OuterSum",), "a sum with a dense array")
    return jnp.asarray(y) + x.materialise()


@rule(add_any_p, dense_output=True)
def _add_any_dense_right(x: OuterSum, y: ArrayLike) -> Array:
    return _plus_dense(x, y)


@rule(add_any_p, dense_output=True)
def _add_any_dense_left(y: ArrayLike, x: OuterSum) -> Array:
    return _plus_dense(x, y)


@rule(jax.lax.reduce_sum_p)
def _reduce_sum(x: OuterSum, *, axes: tuple[int, ...], **params: Any) -> Any:
    """A sum over batch dims is one sum of outer products holding every term (the
    iterations of a scan, summed): the factors side by side."""
    nb = x.batch_ndim
    axes = tuple(sorted(a % x.ndim for a in axes))
    if any(a >= nb for a in axes):
        return densify(
            jax.lax.reduce_sum_p,
            [x],
            dict(axes=axes, **params),
            reason="a sum over a matrix dim",
        )
    keep = [a for a in range(nb) if a not in axes]
    terms = x.left.shape[-1] * math.prod(x.shape[a] for a in axes)

    def merge(factor: Array) -> Array:
        moved = jnp.transpose(factor, (*keep, nb, *axes, nb + 1))
        return moved.reshape(moved.shape[: len(keep) + 1] + (terms,))

    return OuterSum(merge(x.left), merge(x.right), x.spec)


@rule(psum_invariant_p)
def _psum_invariant(x: OuterSum, *, axes: tuple) -> OuterSum | Array:
    """The sum over devices that JAX's AD inserts for the cotangent of a marked
    weight made device-varying inside `shard_map` (the transpose of `pvary`): every
    device's terms side by side, exact, finished afterwards like any other sum.

    Where gathering the terms would receive more than a dense all-reduce of the
    matrix (`devices * B * (m + n) > 2 m n`: many tokens per device), the dense
    matrices are summed instead, exact and counted as a densification whose
    message names the way to keep the saving."""
    axes = tuple(axes)
    devices = axis_size(axes)
    m, n = x.shape[-2:]
    if devices == 1 or devices * x.left.shape[-1] * (m + n) <= 2 * m * n:
        return OuterSum(
            gather_along(x.left, axes, axis=-1),
            gather_along(x.right, axes, axis=-1),
            x.spec,
        )
    total = dense_all_reduce(x.materialise(), axes)
    record_densification(
        psum_invariant_p.name,
        ("OuterSum",),
        f"gathering {devices} devices' {x.left.shape[-1]} terms of a {m}x{n} "
        "gradient would receive more than a dense all-reduce of it",
        "For a marked weight in data-parallel `shard_map`, pass the mesh axis to "
        "`quax_tangents.optax.mark(..., axis_name=...)`: each device then projects "
        "its own gradient, and the sum moves the projected factor only.",
    )
    return total


@rule(reshard_p)
def _reshard(x: OuterSum, *, dst_sharding: Any, **params: Any) -> OuterSum:
    """Typed with `dst_sharding`'s spec, factors unmoved: the weight's sharding for
    the cotangent of a mark (see `spec`), or the transpose of a marked weight's
    `reshard` (an FSDP all-gather before use) sending it back to the stored one."""
    entries = tuple(dst_sharding.spec) + (None,) * (x.ndim - len(dst_sharding.spec))
    return OuterSum(x.left, x.right, entries[-2:])
