"""`mark`: the parameters with the cotangent marks that a `projected` state calls for,
applied inside the loss."""

from collections.abc import Callable
from typing import Any

import jax
import jax.tree_util as jtu
import quax
from jaxtyping import PRNGKeyArray, PyTree

from .._core._devices import axis_is_bound, device_varying
from .._marks._cotangents import Projector, projected_mark, sparse_rows_cotangent
from .._marks._matrix_view import to_matrix
from ._common import AxisName
from ._galore_leaves import LeafPlan
from ._projected import ProjectedState, find_state


def _is_plan_leaf(x: Any) -> bool:
    return x is None or isinstance(x, LeafPlan)


def leaf_keys(key: PRNGKeyArray | None, state: ProjectedState, count: int) -> Any:
    """`count` keys, one per projected leaf, from `key`; without a key, from the step
    count, so that each refresh draws new test matrices.

    The keys are of the `rbg` implementation, whose bits come from XLA's
    `RngBitGenerator`, one instruction: a range finder's test matrix is drawn per
    layer inside the model's backward pass, and with threefry keys the 1B step of
    `benchmarks/bench_scale.py` (4 microbatches, `estimate(..., target="tpu-v5e")`)
    compiled in 52 s, with these in 36 s (Adam's: 14 s). Its bits differ between
    backends.
    """
    if key is None:
        key = jax.random.fold_in(jax.random.key(0), state.count)
    keys = jax.random.split(key, (max(count, 1), 2))
    # Two keys' data per leaf, whatever `key`'s implementation: an rbg key's four
    # words.
    data = jax.random.key_data(keys).reshape(max(count, 1), -1)[:, :4]
    return jax.random.wrap_key_data(data, impl="rbg")


def _paths(treedef: Any) -> list[str]:
    marker = jtu.tree_unflatten(treedef, [_Leaf()] * treedef.num_leaves)
    found = jtu.tree_flatten_with_path(marker, is_leaf=lambda x: isinstance(x, _Leaf))
    return [jtu.keystr(path) for path, _ in found[0]]


class _Leaf:
    pass


def _is_whole(x: Any) -> bool:
    # A compressed value (or None) sits where `flatten_up_to` would put one leaf.
    return x is None or isinstance(x, quax.Value)


def flatten_as(treedef: Any, tree: PyTree, message: str) -> list:
    """`tree`'s leaves down to `treedef`'s, or a `ValueError` that starts with
    `message`.

    A tree whose nodes are of other types but whose leaves sit at the same paths is
    accepted: Flax NNX's `Optimizer` turns the `nnx.Param` nodes of the state it keeps
    into `OptVariable` nodes (both reach their value by `.value`)."""
    try:
        return treedef.flatten_up_to(tree)
    except (ValueError, TypeError) as error:
        found, _ = jtu.tree_flatten_with_path(tree, is_leaf=_is_whole)
        if [jtu.keystr(path) for path, _ in found] == _paths(treedef):
            return [leaf for _, leaf in found]
        raise ValueError(f"{message}: {_shortened(str(error))}") from error


def _shortened(text: str, limit: int = 600) -> str:
    """JAX's structure mismatch quotes the whole value (a model's repr can run to
    thousands of lines): its head says what differs."""
    if len(text) <= limit:
        return text
    return f"{text[:limit]} ... ({len(text) - limit} more characters)"


def plan_leaves(state: ProjectedState, params: PyTree, where: str):
    """(plans, param leaves, projectors, treedef), aligned: one entry per leaf of
    the parameters that `state` was initialised with."""
    if state.plan is None:
        raise ValueError(f"{where}: the state has no plan; initialise it again.")
    plans, treedef = jtu.tree_flatten(state.plan, is_leaf=_is_plan_leaf)
    leaves = flatten_as(
        treedef,
        params,
        f"{where}: `params` must have the structure of the parameters the "
        "optimiser state was initialised with",
    )
    projectors = treedef.flatten_up_to(state.projector)
    return plans, leaves, projectors, treedef


def _mark_leaf(
    leaf: Any,
    plan: LeafPlan | None,
    projector: Any,
    refresh: Any,
    key: Any,
    iters: int,
    by_layer: bool,
    axis_name: AxisName,
) -> Any:
    if plan is None or leaf is None:
        return leaf
    if plan.kind == "rows":
        return sparse_rows_cotangent(leaf)
    return in_matrix_view(
        leaf,
        plan,
        lambda w: projected_mark(
            w,
            plan.rank,
            Projector(projector, refresh),
            key,
            iters,
            # As `accumulate_gradients` finds it: its sums have `rank` columns.
            0,
            by_layer=by_layer,
            axis_name=axis_name,
        ),
    )


def in_matrix_view(leaf: Any, plan: LeafPlan, mark_matrix: Callable) -> Any:
    """`mark_matrix(leaf)`, or for a leaf that `dims=` views as other matrices than
    its last two dims, `mark_matrix` of its matrix view `(*batch, m, n)`, reshaped
    back to the stored shape: the reshape keeps the mark, so products with the
    stored weight (`einsum("btd,dhk->bthk", x, w)`) give the factors of the
    matrix's gradient, and the gradient comes back as a `LowRank` of the matrix
    view (see `quax_tangents._marks._matrix_view`)."""
    if not plan.is_view:
        return mark_matrix(leaf)
    matrix = mark_matrix(to_matrix(leaf, plan.matrix_shape))
    return matrix.reshape(plan.shape)


def mark(
    params: PyTree,
    state: Any,
    *,
    key: PRNGKeyArray | None = None,
    iters: int = 0,
    by_layer: bool = True,
    axis_name: AxisName = None,
) -> PyTree:
    """The parameters with the marks that a [`quax_tangents.optax.projected`][] state
    calls for, so that their gradients come back in the form it takes: on each
    projected leaf (stacked or not) `quax_tangents.projected_cotangent` with the
    state's [`quax_tangents.Projector`][] (a fresh projector on refresh steps), and
    on each leaf chosen with `rows=` `quax_tangents.sparse_rows_cotangent`. The other
    leaves are returned as they are.

    A leaf that `dims=` views as other matrices than its own last two dims (an
    attention weight stored as `(d, heads, head_dim)`, viewed as `(d, heads *
    head_dim)`) is marked through its matrix view `(*batch, m, n)`, and returned
    reshaped to its stored shape (a reshape that keeps the mark): an `einsum` that
    contracts exactly its row dims or exactly its column dims gives the factors of
    the matrix's gradient, and its gradient comes back from `quax_tangents.grad`
    (or `value_and_grad`, `vjp`) as the `LowRank` of the matrix view, *not* of the
    parameter's shape (JAX requires a cotangent of the parameter's shape, and a
    `LowRank` is `(..., m, n)`). `projected` takes it, and
    [`quax_tangents.optax.apply_updates`][] reshapes its updates. Under plain
    `jax.grad` it is the same projection, dense, in the stored shape.

    Call it *inside* the function that `quax_tangents.grad` or `value_and_grad`
    differentiates, on that function's parameters:

    ```python
    def step(params, state, batch):
        marked_loss = lambda p, b: loss_fn(qto.mark(p, state), b)
        loss, grads = qt.value_and_grad(marked_loss)(params, batch)
        updates, state = tx.update(grads, state)
        return qto.apply_updates(params, updates), state, loss
    ```

    **Arguments:**

    - `params`: the parameters (a pytree of arrays, an Equinox module, possibly with
        `None` or non-array leaves where `tx.init` had `None`), with the structure
        the state was initialised with.
    - `state`: the state of `projected`, or a state that contains exactly one
        (an `optax.chain`'s).
    - `key`: the PRNG key of the range finders on refresh steps, split into one key
        per projected leaf. `None` derives one from the state's step count.
    - `iters`: power iterations of the range finders on refresh steps. 0 by
        default, as for `accumulate_gradients` and `galore`, so that a marked loss
        and an accumulated step draw the same projector from the same key (there
        each iteration costs two more passes over the model; here, products with
        the gradient's factors). `quax_tangents.projected_cotangent`, used on its
        own, defaults to 1.
    - `by_layer`: when the loss runs a stacked projected leaf through `lax.scan`
        (the blocks of a scanned model), project each layer's gradient in that
        scan's backward pass, so that one layer's gradient factors (its inputs and
        output cotangents, for every token of the batch) are alive at a time, not
        every layer's. As for `accumulate_gradients`, it needs the stack to be used
        in exactly one scan and nowhere else (a `ValueError` says so otherwise);
        `False` keeps every layer's factors until the scan ends, for any use,
        with the same result.
    - `axis_name`: inside `jax.shard_map`, data parallel (replicated weights, each
        device its part of the batch): the mesh axis the batch is split over. Each
        device then projects its own gradient, and the sum over the devices that
        JAX's differentiation takes of a replicated weight's gradient (the
        transpose of the `pvary` it inserts where the weight meets the device's
        data) moves the projected factor only: an all-reduce of `(m, rank)` per
        projected matrix, whatever the batch (leaves chosen with `rows=` are
        summed as without it). Without it the sum comes first, of the
        gradient's unprojected factors (every token's input and output
        cotangents), and the projection after. The gradient is the same: JAX's own
        sum over the devices (take `lax.pmean` of the loss for the mean). Give it
        only for weights that meet the devices' own data: a marked weight used on
        replicated values alone would have its gradient summed over the devices
        too.

    **Returns:**

    `params`, marked.
    """
    if not isinstance(by_layer, bool):
        raise TypeError(f"`by_layer` must be True or False, got {by_layer!r}.")
    if axis_name is not None and not axis_is_bound(axis_name):
        raise NameError(
            f"`axis_name={axis_name!r}` is not bound here: call `qto.mark(..., "
            "axis_name=...)` inside the body of `jax.shard_map` over that mesh axis, "
            "or leave `axis_name` out."
        )
    inner = find_state(state, "`quax_tangents.optax.mark`")
    plans, leaves, projectors, treedef = plan_leaves(
        inner, params, "`quax_tangents.optax.mark`"
    )
    projected_leaves = [
        i for i, p in enumerate(plans) if p is not None and p.kind == "project"
    ]
    keys = leaf_keys(key, inner, len(projected_leaves))
    key_of = {i: keys[j] for j, i in enumerate(projected_leaves)}
    if axis_name is not None:
        # Varying before the mark: the sum over devices (its transpose) then comes
        # after the mark's projection in the backward pass.
        leaves = [
            device_varying(leaf, axis_name) if i in key_of else leaf
            for i, leaf in enumerate(leaves)
        ]
    marked = [
        _mark_leaf(
            leaf,
            plan,
            projector,
            inner.refresh,
            key_of.get(i),
            iters,
            by_layer,
            axis_name,
        )
        for i, (leaf, plan, projector) in enumerate(zip(leaves, plans, projectors))
    ]
    return jtu.tree_unflatten(treedef, marked)
