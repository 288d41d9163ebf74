"""Entering quax's trace with whole user trees."""

from collections.abc import Callable
from typing import Any

import jax.tree_util as jtu
import quax


def _is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


def enter_trace(fn: Callable) -> Callable:
    """`quax.quaxify(fn, filter_spec=lambda _: True)`: always entering the trace
    (quaxify skips it when no quax value is among the inputs, and values created
    inside the computation, such as compressed cotangents, need it).

    Inputs and outputs cross the boundary as flat leaves, rebuilt inside and
    outside: quaxify maps over them while no trace is current, and some pytree nodes
    read the current trace when they are rebuilt (Flax NNX's `Variable`, which
    fails so on JAX 0.12).
    """

    def entered(*args: Any, **kwargs: Any) -> Any:
        leaves, in_tree = jtu.tree_flatten((args, kwargs), is_leaf=_is_value)
        out_tree = []

        def on_leaves(leaves: list) -> list:
            inner_args, inner_kwargs = jtu.tree_unflatten(in_tree, leaves)
            out_leaves, tree = jtu.tree_flatten(
                fn(*inner_args, **inner_kwargs), is_leaf=_is_value
            )
            out_tree.append(tree)
            return out_leaves

        out_leaves = quax.quaxify(on_leaves, filter_spec=lambda _: True)(leaves)
        return jtu.tree_unflatten(out_tree[-1], out_leaves)

    return entered
