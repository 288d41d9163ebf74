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

import jax
import jax.core
import jax.numpy as jnp
from jaxtyping import Array, ArrayLike, Float

from .._core._base import CompressedArray, densify
from .._core._compat import psum_invariant_p
from .._core._fallback import record_densification
from .._core._lax import add_any_p
from .._core._registry import rule
from .._distributed._devices import gather_along
from .._distributed._sharding import factored_type


class OuterSum(CompressedArray):
    """The matrix `left @ right.T` of shape `(*batch, m, n)`, a sum of `B` outer
    products per batch element.

    **Arguments:**

    - `left`: floating array `(*batch, m, B)`.
    - `right`: floating array `(*batch, n, B)` of the same dtype and leading dims.
    """

    left: Float[Array, "*batch m B"]
    right: Float[Array, "*batch n B"]

    @property
    def batch_ndim(self) -> int:
        return self.left.ndim - 2

    def aval(self) -> jax.core.ShapedArray:
        shape = self.left.shape[:-1] + self.right.shape[-2:-1]
        return factored_type(shape, self.left.dtype, self.left, self.right)

    def materialise(self) -> Array:
        return jnp.matmul(self.left, jnp.swapaxes(self.right, -1, -2))


@rule(add_any_p)
def _add_any(x: OuterSum, y: OuterSum) -> OuterSum | Array:
    if (x.shape, x.dtype) != (y.shape, y.dtype):
        return densify(add_any_p, [x, y], {}, reason="shapes or dtypes differ")
    left = jnp.concatenate([x.left, y.left], axis=-1)
    return OuterSum(left, jnp.concatenate([x.right, y.right], axis=-1))


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

    return OuterSum(merge(x.left), merge(x.right))


@rule(psum_invariant_p)
def _psum_invariant(x: OuterSum, *, axes: tuple) -> OuterSum:
    """The sum over devices that JAX's AD inserts for the cotangent of a marked
    weight made device-varying inside `shard_map` (the transpose of `pvary`): every
    device's terms side by side, exact, finished afterwards like any other sum."""
    axes = tuple(axes)
    return OuterSum(
        gather_along(x.left, axes, axis=-1), gather_along(x.right, axes, axis=-1)
    )
