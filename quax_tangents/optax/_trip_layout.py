"""How the trips' loop of `quax_tangents.optax.accumulate_gradients` lays out what it
carries: which weights it carries (and in which layout it reads them), and the
layout of each leaf's running sum, like its weight's under FSDP."""

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax.core import Tracer
from jax.experimental.layout import Layout, with_layout_constraint
from jax.sharding import NamedSharding
from jaxtyping import Array, PyTree

from .._core._layout import explicit_sharding, is_explicit
from ._data_parallel import WHERE as _WHERE
from ._galore_leaves import LeafPlan
from ._mark import flatten_as


def loop_weights(
    params: PyTree, treedef: Any, carried: list[bool]
) -> tuple[list, Callable[[list], PyTree]]:
    """The leaves of `params` (as `treedef` flattens them) that `carried` flags, and
    the function that puts carried leaves back into `params`.

    The trips' loop carries these weights instead of closing over them, and lays
    them out in row-major order inside it. The TPU compiler of libtpu 0.0.52 gives
    a weight that a loop only reads the layout its matmuls read it in, copying each
    whole stack of weights once before the loop (`(layers, d, d)` attention stacks,
    which the forward pass reads transposed), where earlier compilers, and a pass
    with no loop around it, copy one layer at a time. Carrying the weights is not
    enough, nor is the constraint on weights closed over: the two together keep
    the copies per layer (`benchmarks/bench_loop_layouts.py`). Figures, for one
    chip (`benchmarks/bench_scale.py --target ...`, with and without):

    - the 1B step of one microbatch (v5e): 6.59 GiB without, 6.03 with;
    - the 7B step of 4 microbatches (v5p): 24.71 GiB without, 22.01 with;
    - libtpu 0.0.50.1 and 0.0.42.1: unchanged (6.11 and 5.74 GiB at 1B).

    Only weights whose default layout is row-major on every backend are carried
    (`_tiled`): constrained to row-major inside the loop, a TPU layout of another
    order was copied on every trip (the 1B step held 7.33 GiB on libtpu 0.0.50.1).
    Nor are weights laid out across devices: XLA's partitioner gathers the operand
    of a layout constraint, and the 7B step of an FSDP v5e:8 slice held 4.82 GiB
    per chip instead of 3.16 on libtpu 0.0.50.1."""
    leaves = treedef.flatten_up_to(params)
    indices = [i for i, c in enumerate(carried) if c]

    def with_weights(weights: list) -> PyTree:
        full = list(leaves)
        for i, w in zip(indices, weights):
            full[i] = w
        return jtu.tree_unflatten(treedef, full)

    return [leaves[i] for i in indices], with_weights


def carried_leaves(leaves: list, shardings: Any, treedef: Any) -> list[bool]:
    """Per leaf, whether the trips' loop carries it (`loop_weights`): a weight that
    `_tiled` accepts and that neither `shardings` (`accumulate_gradients`' own) nor
    its type spreads over several devices."""
    given = (
        [None] * len(leaves)
        if shardings is None
        else flatten_as(treedef, shardings, f"{_WHERE}: `shardings`")
    )
    return [
        _tiled(x) and not (_spread(s) or _spread(explicit_sharding(x)))
        for x, s in zip(leaves, given)
    ]


def _spread(sharding: Any) -> bool:
    return isinstance(sharding, NamedSharding) and not sharding.is_fully_replicated


def _tiled(x: Any) -> bool:
    """Whether `x` is a floating array of 2 dims or more whose last two dims fill a
    TPU's tiles (128 columns; 8 rows of 32 bits, more of a narrower type), so that
    its default layout is row-major there as on other backends."""
    if not isinstance(x, (jax.Array, Tracer)) or jnp.ndim(x) < 2:
        return False
    if not jnp.issubdtype(x.dtype, jnp.inexact):
        return False  # not a weight (a key array's dtype has no size)
    rows = 8 * max(1, 4 // jnp.dtype(x.dtype).itemsize)
    return x.shape[-1] % 128 == 0 and x.shape[-2] % rows == 0


def row_major(x: Array) -> Array:
    return with_layout_constraint(x, Layout(major_to_minor=tuple(range(x.ndim))))


def sum_layout(
    sharding: Any, plan: LeafPlan | None, x: Any, projector_side: bool
) -> Any:
    """The layout of a running sum, basis or projector `x` of a weight laid out by
    `sharding`: the sharding itself for a dense sum, one spread over the same mesh
    axes for a factor (`LeafPlan.factor_layout`). None leaves it to XLA."""
    if x is None or sharding is None:
        return None
    if plan is None:
        return sharding
    # Under `Auto` axes (FSDP given `shardings=`) the factors take the weight's
    # other mesh axis on their rows where it divides them, not on the rank: the 7B
    # step on a v5e:8 slice held 3.20 GiB per chip so, against 3.92 with the rank
    # sharded (`benchmarks/bench_scale.py --target tpu-v5e --models 7B --devices
    # 8`). Under `Explicit` axes the layout is the gradient's type, as the state's.
    rows_first = not is_explicit(sharding)
    return plan.factor_layout(sharding, tuple(x.shape), projector_side, rows_first)


def leaf_shardings(shardings: Any, treedef: Any, plans: list, leaves: list) -> list:
    """Per leaf, its `NamedSharding` from `accumulate_gradients(shardings=...)` (by
    default the leaf's own under explicit mesh axes), or None (none given, or a leaf
    seen through another matrix view)."""
    if shardings is None:
        # Under explicit mesh axes a weight's layout is its type: the sums and bases
        # must follow it (a carry's type may not change across a scan).
        return [
            None
            if p is not None and p.kind == "project" and p.is_view
            else explicit_sharding(x)
            for x, p in zip(leaves, plans)
        ]
    flat = flatten_as(
        treedef,
        shardings,
        f"{_WHERE}: `shardings` must have the structure of `params` (the tree "
        "given to `jax.jit`'s `in_shardings`)",
    )
    for s in flat:
        if s is not None and not isinstance(s, NamedSharding):
            raise TypeError(
                f"{_WHERE}: each leaf of `shardings` must be a "
                f"`jax.sharding.NamedSharding` or None, got {type(s).__name__}; "
                "build them with `NamedSharding(mesh, PartitionSpec(...))`."
            )
    return [
        None if p is not None and p.kind == "project" and p.is_view else s
        for s, p in zip(flat, plans)
    ]
