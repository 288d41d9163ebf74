"""Laying out the buffers the library makes (running sums of factors, a refresh's
bases) like the weights they belong to, under XLA's SPMD partitioner.

Buffers made inside a step from nothing the user sharded (zeros, a loop's output)
are replicated by default: each device holds the whole running sum, and each
microbatch's contribution is all-reduced into it. Constrained to a sharding, the
partitioner reduce-scatters the contribution instead, and each device holds its
share.
"""

import math
from typing import Any

import jax
from jax.core import Tracer
from jax.sharding import NamedSharding, PartitionSpec


def factor_layout(
    sharding: NamedSharding | None,
    weight_ndim: int,
    side: int,
    shape: tuple,
    rows_first: bool = False,
) -> NamedSharding | None:
    """The layout of a factor `shape = (*batch, k, width)` of a stack of matrices
    `(*batch, m, n)` laid out by `sharding`, whose dim `k` is the weights' dim
    `side` (`-2` for `m`, `-1` for `n`), so that the factor is as spread out as its
    weight: the batch and `k` dims keep the weights' mesh axes, and the axes of the
    weights' other dim go to the width (a rank) when they divide it, else to `k`
    when it has none and they divide it, else to the width all the same (padded:
    XLA's partitioner allows uneven shards inside a program). With `rows_first`,
    they go to `k` first where it has none and they divide it."""
    if sharding is None:
        return None
    entries = tuple(sharding.spec) + (None,) * (weight_ndim - len(sharding.spec))
    kept, other = entries[side], entries[-1 if side == -2 else -2]
    width = None
    if other is not None:
        size = _mesh_size(sharding, other)
        width_first = shape[-1] % size == 0 and not rows_first
        if not width_first and kept is None and shape[-2] % size == 0:
            kept = other
        else:
            width = other
    spec = PartitionSpec(*entries[:-2], kept, width)
    return NamedSharding(sharding.mesh, spec)


def explicit_sharding(x: Any) -> NamedSharding | None:
    """`x`'s own sharding where it is part of its type (a mesh axis it is sharded
    on is `Explicit`), else None."""
    if not isinstance(x, (jax.Array, Tracer)):
        return None  # None, a Python scalar, a leaf that is no array
    sharding = getattr(jax.typeof(x), "sharding", None)
    if not isinstance(sharding, NamedSharding) or sharding.mesh.empty:
        return None
    return sharding if is_explicit(sharding) else None


def drop_leading(sharding: NamedSharding | None, count: int) -> NamedSharding | None:
    """The layout of one slice `x[i]` (`count` leading dims indexed away) of an
    array laid out by `sharding`."""
    if sharding is None:
        return None
    entries = tuple(sharding.spec)[count:]
    return NamedSharding(sharding.mesh, PartitionSpec(*entries))


def constrain(x: Any, sharding: NamedSharding | None) -> Any:
    """`x` laid out by `sharding`, or `x` itself for `None`."""
    if sharding is None:
        return x
    if is_explicit(sharding):
        # An explicit axis is part of the array's type: change the type.
        return jax.sharding.reshard(x, sharding)
    return jax.lax.with_sharding_constraint(x, sharding)


def is_explicit(sharding: NamedSharding) -> bool:
    """Whether `sharding` uses an `Explicit` mesh axis (its layout is a type)."""
    explicit = jax.sharding.AxisType.Explicit
    types = dict(zip(sharding.mesh.axis_names, sharding.mesh.axis_types))
    used = [
        name
        for entry in sharding.spec
        if entry is not None
        for name in (entry if isinstance(entry, tuple) else (entry,))
    ]
    return any(types[name] == explicit for name in used)


def _mesh_size(sharding: NamedSharding, entry: Any) -> int:
    names = entry if isinstance(entry, tuple) else (entry,)
    return math.prod(sharding.mesh.shape[name] for name in names)
