"""The block layout shared by `Quantized` and `SignNorm`: helpers, the abstract base
`BlockedArray`, and the rules registered once for both.

Both types flatten the trailing "event" dims of the array they represent row-major,
zero-pad the flat vector and split it into equal blocks; any leading dims of their
array fields are batch dims (added by `jax.vmap` or `lax.scan`). Nothing here depends
on what a block stores, only on that layout.
"""

import abc
import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import equinox as eqx
import jax
import jax.core
import jax.numpy as jnp
import numpy as np
from jax import lax
from jaxtyping import Array, ArrayLike

from .._core import _validate
from .._core._base import CompressedArray, densify
from .._core._devices import axis_size, gather
from .._core._registry import rule
from .._core._sharding import varying_type
from .._core._unchecked import unchecked


def event_size(event_shape: Sequence[int]) -> int:
    return math.prod(event_shape)


def num_blocks(size: int, block_elems: int) -> int:
    return -(-size // block_elems)


def check_event_shape(name: str, event_shape: Any) -> tuple[int, ...]:
    """A tuple of non-negative Python ints, or a `TypeError`/`ValueError` naming
    `name`."""
    try:
        dims = tuple(event_shape)
    except TypeError:
        raise TypeError(
            f"`{name}` must be a tuple of ints (the trailing dims of the represented "
            f"array), got {event_shape!r}."
        ) from None
    for d in dims:
        if isinstance(d, bool) or not isinstance(d, (int, np.integer)) or d < 0:
            raise ValueError(
                f"`{name}` must be a tuple of non-negative ints, got {event_shape!r}."
            )
    return tuple(int(d) for d in dims)


def check_value_dtype(name: str, dtype: Any) -> np.dtype:
    """A floating dtype, or a `TypeError` naming `name`."""
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        raise TypeError(f"`{name}` must be a floating dtype, got {dtype!r}.") from None
    if not jnp.issubdtype(dtype, jnp.floating):
        raise TypeError(
            f"`{name}` must be a floating dtype (the dtype of the represented array), "
            f"got {dtype}. Use e.g. `jnp.float32`."
        )
    return dtype


def check_shape(
    name: str, actual: tuple[int, ...], expected: tuple[int, ...], why: str
):
    if tuple(actual) != tuple(expected):
        raise ValueError(
            f"`{name}` has shape {tuple(actual)}, expected {tuple(expected)} ({why})."
        )


def fields_of(module: Any) -> dict[str, Any]:
    """The fields a constructor takes; the guard leaf is left out, so that a value
    rebuilt from them gets a guard of its own batch shape."""
    return {
        f.name: getattr(module, f.name) for f in dataclasses.fields(module) if f.init
    }


def flat_blocks(x: Any, n_blocks: int, block_elems: int) -> Any:
    """`x` flattened row-major to float32, zero-padded and split into blocks of shape
    `(n_blocks, block_elems)`."""
    flat = jnp.reshape(jnp.asarray(x), (-1,)).astype(jnp.float32)
    pad = n_blocks * block_elems - flat.shape[0]
    if pad:
        flat = jnp.pad(flat, (0, pad))
    return flat.reshape(n_blocks, block_elems)


def unblock(blocks: Any, event_shape: tuple[int, ...], dtype: Any) -> Any:
    """The inverse of `flat_blocks` for `blocks` of shape `(*batch, n_blocks, elems)`:
    drops the padding and restores the event dims, cast to `dtype`."""
    batch = blocks.shape[:-2]
    flat = blocks.reshape(*batch, blocks.shape[-2] * blocks.shape[-1])
    flat = flat[..., : event_size(event_shape)]
    return flat.reshape(*batch, *event_shape).astype(dtype)


def reshape_event(
    full_shape: tuple[int, ...], n_batch: int, new_sizes: Sequence[int]
) -> tuple[int, ...] | None:
    """The new event shape when reshaping to `new_sizes` keeps the batch dims, else
    `None`. A reshape never changes the row-major order of the elements, so the block
    layout stays valid whenever the batch dims stay."""
    new_sizes = tuple(int(d) for d in new_sizes)
    if new_sizes[:n_batch] != tuple(full_shape[:n_batch]):
        return None
    return new_sizes[n_batch:]


def transpose_event(
    full_shape: tuple[int, ...], n_batch: int, permutation: Sequence[int]
) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """`(batch_permutation, new_event_shape)` when `permutation` keeps the block
    layout, else `None`.

    The layout survives when batch axes stay among the batch positions (they may be
    permuted among themselves) and the event axes of size other than 1 keep their
    relative order, so that the row-major flat order of the event elements is
    unchanged (moving size-1 axes is free).
    """
    perm = tuple(int(p) for p in permutation)
    batch_perm, event_perm = perm[:n_batch], perm[n_batch:]
    if any(p >= n_batch for p in batch_perm):
        return None
    moved = [p for p in event_perm if full_shape[p] != 1]
    if moved != sorted(moved):
        return None
    return batch_perm, tuple(full_shape[p] for p in event_perm)


def scalar_operand(value_shape: tuple[int, ...], other: Any) -> Any:
    """`other` as a 0-d array when multiplying a value of `value_shape` by it is a
    multiplication by one scalar (a 0-d array, or a size-1 array whose broadcast keeps
    `value_shape`), else `None`."""
    shape = jnp.shape(other)
    if shape == ():
        return jnp.asarray(other)
    if len(shape) == len(value_shape) and all(d == 1 for d in shape):
        return jnp.reshape(other, ())
    return None


def static_fields(event_shape: Any, dtype: Any) -> tuple[Any, Any]:
    """`(event_shape, value_dtype)` as a constructor stores them: a list becomes a
    tuple and a dtype-like becomes a `jnp.dtype`; anything else is kept as given, for
    `__check_init__` to reject with a message naming the argument."""
    if isinstance(event_shape, list):
        event_shape = tuple(event_shape)
    try:
        dtype = jnp.dtype(dtype)
    except TypeError:
        pass
    return event_shape, dtype


class BlockedArray(CompressedArray):
    """Abstract base of the block-wise types ([`quax_tangents.Quantized`][],
    [`quax_tangents.SignNorm`][]).

    A subclass represents an array whose trailing `event_shape` dims are flattened
    row-major, zero-padded and split into `num_blocks` blocks (see the module
    docstring), and stores two array fields: a per-block payload of shape
    `(*batch, num_blocks, bytes_per_block)` and one float32 statistic per block of
    shape `(*batch, num_blocks)` (leading dims are batch dims), plus the static fields
    `event_shape` and `value_dtype`. `_payload_field` and `_stat_field` name the two
    array fields.

    The rules that only move whole blocks or relabel the shape (`transpose`,
    `reshape`, `convert_element_type`, `copy`) are registered once, for this class.
    Subclasses implement `materialise`, `_check_settings`, `_check_payload` and
    `_scaled`, and register their own `neg` and scalar `mul` rules.
    """

    _payload_field: eqx.AbstractClassVar[str]
    _stat_field: eqx.AbstractClassVar[str]
    event_shape: eqx.AbstractVar[tuple[int, ...]]
    value_dtype: eqx.AbstractVar[Any]

    @property
    def _payload(self) -> Array:
        return getattr(self, self._payload_field)

    @property
    def _stats(self) -> Array:
        return getattr(self, self._stat_field)

    @property
    def num_blocks(self) -> int:
        """Blocks per batch element."""
        return self._payload.shape[-2]

    @property
    def batch_ndim(self) -> int:
        return self._payload.ndim - 2

    def aval(self) -> jax.core.ShapedArray:
        shape = (*self._payload.shape[:-2], *self.event_shape)
        # Inside `jax.shard_map`, varying where its blocks or their statistics do.
        return varying_type(shape, self.value_dtype, self._payload, self._stats)

    # --- validation -------------------------------------------------------------

    @abc.abstractmethod
    def _check_settings(self) -> None:
        """Checks the subclass's own static fields (e.g. `bits`, `block_size`)."""

    @abc.abstractmethod
    def _check_payload(self, event_shape: tuple[int, ...]) -> None:
        """Checks the payload's dtype and shape (its ndim is checked already)."""

    def _check_structure(self) -> None:
        """Every check on shapes, dtypes and static fields (none on values), in the
        order: the subclass's settings, `event_shape`, `dtype`, the payload, the
        per-block statistic."""
        self._check_settings()
        event_shape = check_event_shape("event_shape", self.event_shape)
        if not isinstance(self.event_shape, tuple):
            raise TypeError(f"`event_shape` must be a tuple, got {self.event_shape!r}.")
        check_value_dtype("dtype", self.value_dtype)
        _validate.check_ndim(self._payload_field, self._payload, 2)
        self._check_payload(event_shape)
        _validate.check_dtype(self._stat_field, self._stats, jnp.float32)
        stat = self._stat_field.removesuffix("s")
        check_shape(
            self._stat_field,
            self._stats.shape,
            self._payload.shape[:-1],
            f"one {stat} per block of `{self._payload_field}`",
        )

    # --- protocol ---------------------------------------------------------------

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> Array:
        # Every device's blocks are gathered, then decoded and summed in float32
        # whatever the value's dtype: a half-precision sum over many devices would
        # lose the small terms. The sum of codes has no block form, so it is dense.
        gathered = self._with_blocks(
            gather(self._payload, axis_name),
            gather(self._stats, axis_name),
            value_dtype=jnp.float32,
        )
        total = jnp.sum(gathered.materialise(), axis=0)
        if mean:
            total = total / axis_size(axis_name)
        return total.astype(self.value_dtype)

    # --- building results in rules ----------------------------------------------

    def _replace(self, **changes: Any) -> Any:
        """A copy with some fields changed, built without checks (see `unchecked`)."""
        return unchecked(type(self), **{**fields_of(self), **changes})

    def _with_blocks(self, payload: Array, stats: Array, **changes: Any) -> Any:
        return self._replace(
            **{self._payload_field: payload, self._stat_field: stats}, **changes
        )

    def _permute_batch(self, batch_perm: tuple[int, ...]) -> Any:
        n_batch = len(batch_perm)
        if batch_perm == tuple(range(n_batch)):
            return self
        return self._with_blocks(
            jnp.transpose(self._payload, (*batch_perm, n_batch, n_batch + 1)),
            jnp.transpose(self._stats, (*batch_perm, n_batch)),
        )

    @abc.abstractmethod
    def _scaled(self, scalar: Array, dtype: np.dtype) -> Any:
        """The value times the 0-d float32 `scalar` (possibly traced), as `dtype`."""

    def _mul_scalar(
        self, other: ArrayLike, values: tuple[Any, Any], params: dict[str, Any]
    ) -> Any:
        """`mul_p` of this value and `other` (`values` in the primitive's order):
        `_scaled` when `other` is a scalar and the output floating, else dense."""
        scalar = scalar_operand(self.shape, other)
        out_dtype = params.get("out_dtype")
        out_dtype = self.dtype if out_dtype is None else jnp.dtype(out_dtype)
        if scalar is None:
            return densify(
                lax.mul_p, values, params, reason="product with a non-scalar"
            )
        if not jnp.issubdtype(out_dtype, jnp.floating):
            return densify(lax.mul_p, values, params, reason="non-floating `out_dtype`")
        return self._scaled(scalar.astype(jnp.float32), jnp.dtype(out_dtype))


# ---------------------------------------------------------------------------------
# Rules shared by every `BlockedArray`. Each keeps the type where the result is exactly
# representable and otherwise densifies through `densify` (counted, subject to the
# fallback mode).


@rule(lax.convert_element_type_p)
def _convert_element_type(x: BlockedArray, **params: Any) -> BlockedArray | Array:
    new_dtype = jnp.dtype(params["new_dtype"])
    if not jnp.issubdtype(new_dtype, jnp.floating):
        return densify(
            lax.convert_element_type_p,
            (x,),
            params,
            reason=f"conversion to {new_dtype}",
        )
    if params.get("sharding") is not None:
        return densify(
            lax.convert_element_type_p, (x,), params, reason="explicit output sharding"
        )
    return x._replace(value_dtype=new_dtype)


@rule(lax.copy_p)
def _copy(x: BlockedArray) -> BlockedArray:
    return x._with_blocks(jnp.copy(x._payload), jnp.copy(x._stats))


@rule(lax.transpose_p)
def _transpose(x: BlockedArray, **params: Any) -> BlockedArray | Array:
    permutation = params["permutation"]
    n_batch = x._payload.ndim - 2
    layout = transpose_event(x.shape, n_batch, permutation)
    if layout is None:
        return densify(
            lax.transpose_p,
            (x,),
            params,
            reason="the permutation reorders the flat event elements",
        )
    batch_perm, event_shape = layout
    return x._permute_batch(batch_perm)._replace(event_shape=event_shape)


@rule(lax.reshape_p)
def _reshape(x: BlockedArray, **params: Any) -> BlockedArray | Array:
    n_batch = x._payload.ndim - 2
    shape, out = x.shape, x
    dimensions = params.get("dimensions")
    if params.get("sharding") is not None:
        return densify(lax.reshape_p, (x,), params, reason="explicit output sharding")
    if dimensions is not None:
        layout = transpose_event(shape, n_batch, dimensions)
        if layout is None:
            return densify(
                lax.reshape_p, (x,), params, reason="`dimensions` reorders the elements"
            )
        batch_perm, event_shape = layout
        out = x._permute_batch(batch_perm)._replace(event_shape=event_shape)
        shape = out.shape
    event_shape = reshape_event(shape, n_batch, params["new_sizes"])
    if event_shape is None:
        return densify(
            lax.reshape_p, (x,), params, reason="the reshape moves batch dims"
        )
    return out._replace(event_shape=event_shape)
