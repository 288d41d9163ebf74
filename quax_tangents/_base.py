"""The protocol every compressed representation implements, and the shared fallback."""

import abc
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jaxtyping import Array, PyTree
from quax.examples.zero import Zero

from ._fallback import record_densification
from ._lax import add_any_p
from ._registry import rule


class CompressedArray(quax.ArrayValue):
    """Abstract base of every compressed representation.

    A subclass stores a smaller (possibly lossy) structure and presents itself to JAX
    as a dense array of `aval()`'s shape and dtype. Subclasses implement `aval` and
    `materialise`; storage accounting and the fallback rule are shared.
    """

    @abc.abstractmethod
    def aval(self) -> jax.core.ShapedArray: ...

    @abc.abstractmethod
    def materialise(self) -> Array: ...

    @property
    def batch_ndim(self) -> int:
        """How many leading dims every field shares as batch dims, so that slicing
        every field along them (as `lax.scan` and `vmap` do) slices the value."""
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the sum over the array fields."""
        return sum(
            math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jtu.tree_leaves(self)
        )

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense array this value represents."""
        aval = self.aval()
        return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize

    @property
    def compression_ratio(self) -> float:
        """`dense_nbytes / nbytes`: how many times smaller than dense."""
        return self.dense_nbytes / max(self.nbytes, 1)

    @staticmethod
    def default(
        primitive: jexc.Primitive, values: Sequence[Any], params: dict[str, Any]
    ) -> Any:
        return densify(primitive, values, params, reason="no rule for these operands")


def densify(
    primitive: jexc.Primitive,
    values: Sequence[Any],
    params: dict[str, Any],
    *,
    reason: str,
) -> Any:
    """Materialises every quax value, records it with the fallback policy, and runs
    the primitive densely. Rules call this when they cannot stay compressed."""
    names = tuple(
        sorted({type(v).__name__ for v in values if isinstance(v, CompressedArray)})
    )
    record_densification(primitive.name, names, reason)
    arrays = [v.materialise() if isinstance(v, quax.Value) else v for v in values]
    return primitive.bind(*arrays, **params)


def materialise_values(tree: PyTree) -> PyTree:
    """Dense arrays for every concrete quax value in a pytree (see the public
    `quax_tangents.materialise`, which also reaches values inside a trace)."""
    return jtu.tree_map(
        lambda x: x.materialise() if isinstance(x, quax.Value) else x,
        tree,
        is_leaf=lambda x: isinstance(x, quax.Value),
    )


def call_with_rules(fn: Any, *args: Any) -> Any:
    """Runs `fn` so that primitives on quax values inside a rule dispatch again."""
    return quax.quaxify(fn)(*args)


def _check_zero_matches(x: CompressedArray, zero: Zero) -> None:
    if x.shape != zero.shape or x.dtype != zero.dtype:
        raise TypeError(
            f"Cannot add a {type(x).__name__} of {x.dtype}{list(x.shape)} and a Zero "
            f"of {zero.dtype}{list(zero.shape)}."
        )


# A symbolic zero adds nothing. JAX's own symbolic zeros never reach a primitive; quax's
# `Zero` does, and `add_any` is how JAX accumulates tangents and cotangents.
@rule(add_any_p)
def _add_any_zero_right(x: CompressedArray, y: Zero) -> CompressedArray:
    _check_zero_matches(x, y)
    return x


@rule(add_any_p)
def _add_any_zero_left(x: Zero, y: CompressedArray) -> CompressedArray:
    _check_zero_matches(y, x)
    return y


@rule(jax.lax.add_p)
def _add_zero_right(x: CompressedArray, y: Zero) -> CompressedArray:
    _check_zero_matches(x, y)
    return x


@rule(jax.lax.add_p)
def _add_zero_left(x: Zero, y: CompressedArray) -> CompressedArray:
    _check_zero_matches(y, x)
    return y


@rule(jax.lax.sub_p)
def _sub_zero(x: CompressedArray, y: Zero) -> CompressedArray:
    _check_zero_matches(x, y)
    return x


@rule(jax.lax.sub_p)
def _zero_sub(x: Zero, y: CompressedArray) -> CompressedArray:
    _check_zero_matches(y, x)
    return call_with_rules(jax.lax.neg, y)
