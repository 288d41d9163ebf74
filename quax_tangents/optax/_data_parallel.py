"""Data parallel inside `jax.shard_map` for `accumulate_gradients(axis_name=...)`:
each device's own gradient of the replicated weights, its sums typed as varying
over the axis, the mean over the devices taken once per step; and the refusal of
values that differ per device along an axis not named."""

from collections.abc import Callable, Hashable
from typing import Any

import jax.tree_util as jtu
from jaxtyping import PyTree

from .._core._compat import check_vma_enabled
from .._core._devices import AxisName, axes_of, axis_is_bound, device_varying
from .._core._sharding import varying_axes


WHERE = "`quax_tangents.optax.accumulate_gradients`"


def refuse_per_device(inputs: PyTree, axis_name: AxisName) -> None:
    """Refuses parameters or microbatches that differ per device inside
    `jax.shard_map` (a batch split over a mesh axis) along an axis that `axis_name`
    does not name: each device would find its own projectors from its own share of
    the batch on a refresh step, and the states would part."""
    varying = frozenset().union(*map(varying_axes, jtu.tree_leaves(inputs)))
    extra = varying - set(() if axis_name is None else axes_of(axis_name))
    if extra:
        names = ", ".join(repr(a) for a in sorted(extra, key=str))
        axes = names if len(extra) == 1 else f"({names})"
        raise ValueError(
            f"{WHERE} (and `opt.value_and_grad`): the batch or the parameters "
            f"differ per device along the mesh axes {names} (split over them inside "
            "`jax.shard_map`), where each device would find its own projectors from "
            f"its own share of the batch. Pass `axis_name={axes}`: the projectors "
            "are then found from the whole batch's gradient, the same on every "
            "device, and the gradients averaged over the devices as small factors. "
            "Or compile the step with `jax.jit`, the batch sharded over that axis."
        )


def varying_over(axis_name: AxisName) -> Callable[[PyTree], PyTree]:
    """Types a tree's arrays as varying over `axis_name` (a no-op without one, and
    under `shard_map(..., check_vma=False)`, where nothing is typed)."""
    if axis_name is None or not check_vma_enabled():
        return lambda tree: tree
    return lambda tree: device_varying(tree, axis_name)


def check_axis_name(axis_name: AxisName, shardings: Any) -> None:
    if axis_name is None:
        return
    names = axis_name if isinstance(axis_name, tuple) else (axis_name,)
    if not all(isinstance(name, Hashable) for name in names):
        raise TypeError(
            f"{WHERE}: `axis_name` must be a mesh axis name or a tuple of them, got "
            f"{axis_name!r}."
        )
    if shardings is not None:
        raise ValueError(
            f"{WHERE}: pass `axis_name` (data parallel inside `jax.shard_map`) or "
            "`shardings` (parameters sharded under `jax.jit`), not both."
        )
    if not axis_is_bound(axis_name):
        raise NameError(
            f"{WHERE}: `axis_name={axis_name!r}` is not bound here: call the step "
            "inside the body of `jax.shard_map` over that mesh axis, or leave "
            "`axis_name` out under `jax.jit`."
        )
