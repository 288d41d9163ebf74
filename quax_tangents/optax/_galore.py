"""`galore`: the projected-training pipeline as one object whose plain step is the
fast step.

The pieces it composes (`projected`, `quantized_state`, `layerwise`, `mark`,
`accumulate_gradients`, `apply_updates`) stay public, but which of their many
compositions holds little memory is not something a user should have to find: the
gradient of a step has to come from `accumulate_gradients` (which keeps only the
small factors, one layer at a time), and the 8-bit state has to be decoded one layer's
slice at a time (`layerwise` outside `quantized_state` outside `projected`). `GaLore`
owns that plan.
"""

from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, PRNGKeyArray, PyTree

from .._core._sharding import explicit_axes, spec_entries
from ._accumulate import accumulate_gradients
from ._apply import apply_updates
from ._clip import check_max_norm, clipping, scaled_by_clip
from ._common import AxisName, Filter, check_int, split_arrays
from ._decay import check_weight_decay, decayed_weights
from ._galore_leaves import DimsSpec, LeafPlan
from ._layerwise import layerwise
from ._mark import mark
from ._projected import (
    LearningRate,
    check_step_sign,
    check_steps_descend,
    find_state,
    learning_rate_at,
    projected,
)
from ._quantized_state import QuantizedState, quantized_state


_WHERE = "`quax_tangents.optax.galore`"


def _split_batch(batch: PyTree, microbatches: int) -> PyTree:
    def split(x: Any) -> Any:
        if not jnp.ndim(x):
            raise ValueError(
                "`value_and_grad`'s batch must lead with a batch dim on every leaf "
                f"(split `microbatches={microbatches}` ways); got a 0-d leaf. Close "
                "over values that are not per example instead of passing them in "
                "the batch."
            )
        size = jnp.shape(x)[0]
        if size % microbatches:
            raise ValueError(
                f"`microbatches={microbatches}` must divide the batch's leading dim, "
                f"which is {size} for a leaf of shape {jnp.shape(x)}; pass a batch "
                "whose every leaf leads with a multiple of it."
            )
        shape = (microbatches, size // microbatches, *jnp.shape(x)[1:])
        if not explicit_axes():
            return jnp.reshape(x, shape)
        # Each microbatch split over the devices as the batch was: the scan over
        # microbatches slices an unsharded leading dim.
        return jnp.reshape(x, shape, out_sharding=P(None, *spec_entries(x)))

    return jax.tree.map(split, batch)


def _stacked_layers(plan: Any) -> int:
    """The number of layers of the stacked projected leaves (their leading dim),
    or 1 where no projected leaf is stacked."""
    plans = jax.tree.leaves(plan, is_leaf=lambda x: isinstance(x, LeafPlan))
    leading = [p.shape[0] for p in plans if isinstance(p, LeafPlan) and p.batch_ndim]
    return max(leading, default=1)


class _Frozen:
    """A tree (`project=`, `rows=`, `dims=`) held as its structure and leaves, which
    hash: `GaLore`'s fields are static, and `jax.jit(opt.init)` hashes them (a dict
    of bools does not hash)."""

    __slots__ = ("leaves", "treedef")

    def __init__(self, tree: Any):
        self.leaves, self.treedef = jax.tree.flatten(tree)
        self.leaves = tuple(self.leaves)

    @property
    def tree(self) -> Any:
        return jax.tree.unflatten(self.treedef, self.leaves)

    def __hash__(self) -> int:
        return hash((self.treedef, self.leaves))

    def __eq__(self, other: object) -> bool:
        return (
            isinstance(other, _Frozen)
            and self.treedef == other.treedef
            and self.leaves == other.leaves
        )


def _frozen(tree: Any) -> Any:
    try:
        hash(tree)
    except TypeError:
        return _Frozen(tree)
    return tree


def _thawed(field: Any) -> Any:
    return field.tree if isinstance(field, _Frozen) else field


class GaLore(eqx.Module):
    """The projected-training pipeline; see [`quax_tangents.optax.galore`][]."""

    base: optax.GradientTransformation = eqx.field(static=True)
    rank: int = eqx.field(static=True)
    learning_rate: LearningRate = eqx.field(static=True)
    refresh_every: int = eqx.field(static=True)
    scale: float = eqx.field(static=True)
    state_bits: int | None = eqx.field(static=True)
    # Held hashable (`_Frozen`); read through the properties below.
    _project: Any = eqx.field(static=True)
    _rows: Any = eqx.field(static=True)
    _dims: Any = eqx.field(static=True)
    iters: int = eqx.field(static=True)
    max_grad_norm: float | None = eqx.field(static=True, default=None)
    weight_decay: float = eqx.field(static=True, default=0.0)
    _weight_decay_mask: Any = eqx.field(static=True, default=None)

    @property
    def project(self) -> Filter:
        return _thawed(self._project)

    @property
    def rows(self) -> Filter:
        return _thawed(self._rows)

    @property
    def dims(self) -> DimsSpec:
        return _thawed(self._dims)

    @property
    def weight_decay_mask(self) -> Any:
        return _thawed(self._weight_decay_mask)

    def _decay_at(self, state: Any) -> Array:
        """The fraction of each weight that this step's decay takes off: the
        learning rate at the step count the update scales by, times
        `weight_decay`."""
        # `galore` refuses a weight decay without a learning rate.
        assert self.learning_rate is not None
        count = find_state(state, "weight decay").count
        return learning_rate_at(self.learning_rate, count) * self.weight_decay

    def _projected(self) -> optax.GradientTransformation:
        return projected(
            self.base,
            rank=self.rank,
            learning_rate=self.learning_rate,
            refresh_every=self.refresh_every,
            scale=self.scale,
            project=self.project,
            rows=self.rows,
            dims=self.dims,
        )

    def _per_step(self) -> optax.GradientTransformation:
        tx = self._projected()
        if self.state_bits is not None:
            tx = quantized_state(tx, bits=self.state_bits)
        return tx

    def init(self, params: PyTree) -> Any:
        """The optimiser state for `params` (a tree of arrays, an Equinox model's
        arrays, a Flax `nnx.State`...). A `ValueError` if `project=` and `rows=`
        choose no leaf: the pipeline would then be plain Adam, at Adam's memory.
        A whole Equinox model's leaves that are not arrays are left out."""
        params = split_arrays(params)[0]
        state = self._per_step().init(params)
        plans = jax.tree.leaves(
            find_state(state, "`GaLore.init`").plan,
            is_leaf=lambda x: isinstance(x, LeafPlan),
        )
        if not any(isinstance(plan, LeafPlan) for plan in plans):
            if self.project is None and self.rows is None and self.dims is None:
                raise ValueError(_rank_too_large(params, self.rank))
            raise ValueError(
                "`qto.galore`: `project=` (and `rows=`) chose no leaf of `params`, so "
                "no gradient would be projected. Pass a tree of bools with the "
                "structure of `params`, or a callable given the whole tree that "
                "returns one (e.g. `lambda p: jax.tree.map(lambda x: x.ndim == 2, p)`"
                "); `None` projects every leaf of 2 dims or more whose smaller side "
                "exceeds `rank`."
            )
        return state

    def mark(
        self,
        params: PyTree,
        state: Any,
        *,
        key: PRNGKeyArray | None = None,
        by_layer: bool = True,
    ) -> PyTree:
        """`params` with the marks the state calls for, inside a loss that
        `quax_tangents.value_and_grad` differentiates ([`quax_tangents.optax.mark`][]
        with this pipeline's `iters`; `by_layer` as there). `value_and_grad`
        applies them itself."""
        return mark(params, state, key=key, iters=self.iters, by_layer=by_layer)

    def value_and_grad(
        self,
        loss_fn: Callable,
        *,
        microbatches: int = 1,
        has_aux: bool = False,
        shardings: PyTree | None = None,
        axis_name: AxisName = None,
    ) -> Callable:
        """`loss_fn`'s value and the gradients `update` takes.

        **Arguments:**

        - `loss_fn`: `loss_fn(params, batch) -> loss` (or `(loss, aux)` with
            `has_aux`), the mean loss of a batch, without marks.
        - `microbatches`: split the batch (every leaf's leading dim) into this many
            microbatches and add their gradients up inside the step
            ([`quax_tangents.optax.accumulate_gradients`][]): the same gradient, with
            one microbatch's activations alive at a time.
        - `has_aux`: whether `loss_fn` returns `(loss, aux)`.
        - `shardings`: under FSDP, the parameters' `NamedSharding`s, as for
            `accumulate_gradients`.
        - `axis_name`: data parallel inside `jax.shard_map` (the batch split over
            this mesh axis, the parameters and state replicated): the loss and the
            gradients of the whole batch on every device, averaged over the devices
            as small factors, as for `accumulate_gradients`.

        **Returns:**

        A function `(params, state, batch) -> (value, grads)`. `params` may be a
        whole Equinox model (in a step under `equinox.filter_jit`), as for
        `equinox.filter_value_and_grad`: its leaves that are not arrays (activation
        functions, a dropout's rate) reach `loss_fn` as they are and get `None`
        gradients; `init`, `update` and `apply` take the whole model too.
        """
        microbatches = check_int("microbatches", microbatches, 1)

        def value_and_grad(params: PyTree, state: Any, batch: PyTree) -> Any:
            self._check_state(
                state, "`GaLore.value_and_grad(loss_fn)(params, state, batch)`"
            )
            return accumulate_gradients(
                loss_fn,
                params,
                state,
                _split_batch(batch, microbatches),
                iters=self.iters,
                has_aux=has_aux,
                shardings=shardings,
                axis_name=axis_name,
            )

        return value_and_grad

    def update(self, grads: PyTree, state: Any, params: PyTree) -> tuple[Any, Any]:
        """The updates and the new state. Stacked leaves (`(layers, ...)`, a scanned
        model's blocks) are updated one layer's slice at a time
        ([`quax_tangents.optax.layerwise`][]), so that only one layer's state is
        decoded from its 8-bit codes at once."""
        self._check_state(state, "`GaLore.update(grads, state, params)`")
        params = split_arrays(params)[0]
        return self.transformation(params, state).update(grads, state, params)

    def _check_state(self, state: Any, where: str) -> None:
        """Refuses a state that this pipeline's `init` did not make, by name."""
        find_state(state, where, "`opt.value_and_grad(loss_fn, microbatches=k)`")
        eight_bit = isinstance(state, QuantizedState)
        if eight_bit != (self.state_bits is not None):
            kind = "8-bit" if eight_bit else "float"
            raise TypeError(
                f"{where}: `state` is a {kind} state ({type(state).__name__}), but "
                f"this pipeline has `state_bits={self.state_bits!r}`. Pass the state "
                "its own `init` made (`opt.init(params)`), or build the pipeline "
                f"with `state_bits={8 if eight_bit else None}` to resume that state."
            )

    def apply(self, params: PyTree, updates: PyTree) -> PyTree:
        """`params` plus the updates ([`quax_tangents.optax.apply_updates`][]: each
        `LowRank` update added into its weight in one pass, with the weight decay
        of a [`quax_tangents.optax.Decayed`][] update in the same pass)."""
        return apply_updates(params, updates)

    def transformation(
        self, params: PyTree, state: Any | None = None
    ) -> optax.GradientTransformationExtraArgs:
        """The pipeline's update as an optax `GradientTransformation`, for
        `optax.chain` or an existing training loop. Its layer count is read from
        `params` (or from `state`'s plan): the leading dim of the stacked projected
        leaves. Not for `optax.MultiSteps`, which mixes the state's compressed
        leaves field by field: accumulate microbatches with
        `value_and_grad(loss_fn, microbatches=k)`."""
        if state is None:
            state = jax.eval_shape(self.init, split_arrays(params)[0])
        layers = _stacked_layers(find_state(state, "`GaLore.transformation`").plan)
        tx = self._per_step()
        if self.max_grad_norm is not None:
            tx = scaled_by_clip(tx)
        if layers > 1:
            tx = layerwise(tx, layers=layers)
        if self.max_grad_norm is not None:
            # The norm of all the gradients, before the loop over layers; each slice
            # is scaled inside it.
            tx = clipping(self.max_grad_norm, tx)
        if self.weight_decay > 0:
            tx = decayed_weights(tx, decay=self._decay_at, mask=self.weight_decay_mask)
        return optax.with_extra_args_support(tx)


def galore(
    base: optax.GradientTransformation | None = None,
    *,
    rank: int,
    learning_rate: LearningRate = None,
    refresh_every: int = 200,
    scale: float = 1.0,
    state_bits: int | None = 8,
    project: Filter = None,
    rows: Filter = None,
    dims: DimsSpec = None,
    iters: int = 0,
    max_grad_norm: float | None = None,
    weight_decay: float = 0.0,
    weight_decay_mask: Any = None,
) -> GaLore:
    """GaLore training in one object: projected gradients that are never dense,
    `base` (Adam by default) on their small factors, its state in 8 bits, and
    updates added into the weights, with the step written plainly:

    ```python
    opt = qto.galore(rank=128, learning_rate=1e-3, project=is_matrix)
    state = opt.init(params)

    def step(params, state, batch):
        loss, grads = opt.value_and_grad(loss_fn)(params, state, batch)
        updates, state = opt.update(grads, state, params)
        return opt.apply(params, updates), state, loss
    ```

    From a step written for `optax.adam` three lines change: the optimiser, the
    gradient (`opt.value_and_grad` in place of `jax.value_and_grad`) and the apply
    (`opt.apply` in place of `optax.apply_updates`). `microbatches=k` in
    `value_and_grad` accumulates `k` microbatches inside the step.

    **Arguments:**

    - `base`: the transformation on the small factors; `optax.scale_by_adam()`
        unless given. It runs on one layer's slice of a stacked model at a time,
        so it must treat the elements of its gradients independently (Adam and the
        other `optax.scale_by_*` do): a `base` that reduces over leaves, such as
        `optax.clip_by_global_norm`, would see one layer; clip with
        `max_grad_norm` instead. A `base` that reads the parameters
        (`optax.adamw`'s weight decay) is refused.
    - `rank`: the projection's rank.
    - `learning_rate`, `refresh_every`, `scale`, `project`, `rows`, `dims`: as for
        [`quax_tangents.optax.projected`][]. `base`'s first update is probed for a
        gradient of ones: a direction (`optax.scale_by_adam()`, positive) needs
        `learning_rate`, and one that already steps down the gradient
        (`optax.adam(lr)`, negative) is refused with one; a `ValueError` says
        which.
    - `state_bits`: 8 stores `base`'s state as 8-bit codes
        ([`quax_tangents.optax.quantized_state`][]); `None` keeps it in float.
    - `iters`: power iterations of the range finder on refresh steps, for the marks
        and the accumulation alike. Each brings the projector closer to the top
        singular vectors and costs two more passes over the batch on refresh steps
        (two more trips of the refresh's loop, not more copies of the model's pass
        in the compiled step); 0 by default. At small ranks (under about 16) one
        recovers most of what the range finder without oversampling loses
        (`benchmarks/bench_oversample.py`).
    - `max_grad_norm`: clip the gradients to this global norm before `base`, as
        `optax.chain(optax.clip_by_global_norm(max_grad_norm), ...)` does for dense
        ones ([`quax_tangents.optax.clip_by_global_norm`][]: the norm of a
        projected gradient is that of its projection, taken from its factors);
        `None` (the default) does not clip.
    - `weight_decay`: decoupled weight decay, as `optax.adamw`'s: each step takes
        `learning_rate * weight_decay` of each weight off (the learning rate at that
        step, for a schedule), besides the update. It is applied by `apply`, in the
        same pass that adds the update (the update is a
        [`quax_tangents.optax.Decayed`][]): no weight-sized array is formed. Needs
        `learning_rate`. 0 (the default) turns it off.
    - `weight_decay_mask`: which weights decay: `None` (every one, as
        `optax.adamw`'s default), or a tree of bools with the structure of the
        parameters, or a callable given them that returns one (e.g. `lambda p:
        jax.tree.map(lambda x: x.ndim >= 2, p)` to leave norms and biases alone).

    **Returns:**

    A [`quax_tangents.optax.GaLore`][] with `init`, `value_and_grad`, `mark`,
    `update`, `apply` and `transformation`.
    """
    if base is None:
        base = optax.scale_by_adam()
    if not isinstance(base, optax.GradientTransformation):
        raise TypeError(
            f"`base` must be an optax GradientTransformation, e.g. "
            f"`optax.scale_by_adam()`; got {type(base).__name__}."
        )
    weight_decay = check_weight_decay(weight_decay)
    if weight_decay > 0 and learning_rate is None:
        raise ValueError(
            "`weight_decay` needs `learning_rate`: each step takes `learning_rate * "
            "weight_decay` of each weight off, and with `learning_rate=None` the "
            "learning rate lives inside `base`, where the pipeline cannot read it. "
            "Pass `learning_rate=` (a float or an optax schedule) and leave it out of "
            "`base` (`base=optax.scale_by_adam()`)."
        )
    if state_bits is not None and (isinstance(state_bits, bool) or state_bits != 8):
        raise ValueError(
            f"`state_bits` must be 8 (8-bit state) or None (float state), not "
            f"{state_bits!r}."
        )
    opt = GaLore(
        base=base,
        rank=check_int("rank", rank, 1),
        learning_rate=learning_rate,
        refresh_every=check_int("refresh_every", refresh_every, 1),
        scale=scale,
        state_bits=state_bits,
        _project=_frozen(project),
        _rows=_frozen(rows),
        _dims=_frozen(dims),
        iters=check_int("iters", iters, 0),
        max_grad_norm=(
            None
            if max_grad_norm is None
            else check_max_norm(max_grad_norm, "max_grad_norm")
        ),
        weight_decay=weight_decay,
        _weight_decay_mask=_frozen(weight_decay_mask),
    )
    # After the arguments' own checks: the probe runs `base`.
    if learning_rate is None:
        check_steps_descend(base, _WHERE)
    else:
        check_step_sign(base, learning_rate, _WHERE)
    return opt


def _rank_too_large(params: PyTree, rank: int) -> str:
    """The error of `project=None` that projects nothing: no matrix's smaller side
    exceeds `rank`."""
    sides = [
        min(jnp.shape(x)[-2:]) for x in jax.tree.leaves(params) if jnp.ndim(x) >= 2
    ]
    largest = (
        f"the largest smaller side of a leaf of `params` is {max(sides)}"
        if sides
        else "`params` has no leaf of 2 dims or more"
    )
    return (
        f"`qto.galore`: with `project=None`, a leaf is projected when its smaller "
        f"side exceeds `rank={rank}`, and {largest}, so no gradient would be "
        "projected. Pass a smaller `rank`."
    )
