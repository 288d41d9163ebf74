"""`shard_map` specs for optimiser states that hold per-device fields."""

from collections.abc import Hashable
from typing import Any

import jax.tree_util as jtu
from jax.sharding import PartitionSpec
from jaxtyping import PyTree

from .._core._guard import is_guard
from ._compress import CompressState
from ._powersgd import PowerSGDState


def _specs(tree: PyTree, spec: PartitionSpec) -> PyTree:
    # A compressed value's guard leaf is replicated and may be 0-d: always `P()`.
    return jtu.tree_map(lambda x: PartitionSpec() if is_guard(x) else spec, tree)


def partition_specs(
    state: PyTree, axis_name: Hashable, param_specs: PyTree | None = None
) -> PyTree:
    """`shard_map` specs for an optimiser state that contains this module's states.

    Per-device fields (carried errors and EF21 estimates) get `P(axis_name)`: each
    device's array is one block of a global array concatenated along the first
    axis, so the state can leave `shard_map` and come back to the same device.
    Everything else gets `P()` (replicated), including the states of other optax
    transformations, unless `param_specs` is given: then every subtree of the state
    with the parameters' structure (Adam's moments, for example) gets `param_specs`,
    as for sharded training (`compress(..., sharded=True)`).

    **Arguments:**

    - `state`: the optimiser state, or its shapes (`jax.eval_shape(tx.init, params)`).
    - `axis_name`: the mesh axis of the compressing transformations.
    - `param_specs`: the specs of the parameters (a pytree of `PartitionSpec` with
        their structure), when they are sharded.

    **Returns:**

    A pytree of `PartitionSpec`s with `state`'s structure.
    """
    varying, replicated = PartitionSpec(axis_name), PartitionSpec()

    def specs(node: Any) -> Any:
        if isinstance(node, CompressState):
            return CompressState(
                _specs(node.error, varying),
                _specs(node.estimate, varying),
                _specs(node.aggregate, replicated),
                _specs(node.server_error, varying),
            )
        if isinstance(node, PowerSGDState):
            return PowerSGDState(
                replicated,  # pyright: ignore[reportArgumentType]
                _specs(node.q, replicated),
                _specs(node.error, varying),
            )
        if param_structure is not None and _structure(node) == param_structure:
            return param_specs
        return replicated

    param_structure = None if param_specs is None else _structure(param_specs)
    return jtu.tree_map(
        specs,
        state,
        is_leaf=lambda x: (
            isinstance(x, (CompressState, PowerSGDState))
            or (param_structure is not None and _structure(x) == param_structure)
        ),
    )


def _structure(tree: PyTree) -> Any:
    return jtu.tree_structure(tree, is_leaf=lambda x: isinstance(x, PartitionSpec))
