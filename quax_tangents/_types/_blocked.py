"""Layout helpers shared by the block-wise types (`Quantized`, `SignNorm`).

Both types flatten the trailing "event" dims of the array they represent row-major,
zero-pad the flat vector and split it into equal blocks; any leading dims of their
array fields are batch dims (added by `jax.vmap` or `lax.scan`). Nothing here depends
on what a block stores, only on that layout.
"""

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax.numpy as jnp
import numpy as np


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


def unchecked(cls: type, **fields: Any) -> Any:
    """Builds a module of `cls` from all of its fields without running `__init__` or
    `__check_init__`, exactly as unflattening under `jit`/`vmap` does.

    Rules use it: their outputs are consistent by construction, and value checks
    (finiteness) must not fire on legitimate dense semantics such as `x * inf`.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != names:
        raise TypeError(
            f"{cls.__name__} needs fields {sorted(names)}, got {sorted(fields)}."
        )
    obj = object.__new__(cls)
    for name, value in fields.items():
        object.__setattr__(obj, name, value)
    return obj


def fields_of(module: Any) -> dict[str, Any]:
    return {f.name: getattr(module, f.name) for f in dataclasses.fields(module)}


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
