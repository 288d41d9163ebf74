"""Running a transformation on one layer at a time: `layerwise` splits every stacked
leaf along its leading axis and updates one slice per iteration of a loop that writes
the state in place, so that the transformation's intermediates (a decoded 8-bit
state, Adam's float32 moments, the updates before they are cast) are one layer's
size, not the model's.
"""

from typing import Any, NamedTuple, cast

import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import optax
from jax import lax
from jaxtyping import PyTree

from .._core._guard import guard, is_guard
from .._core._sharding import like
from .._types.lowrank import LowRank
from .._types.rows import SparseRows
from ._apply import is_compressed
from ._common import Filter, check_int, mask_flags, traced
from ._projected import ProjectedState
from ._stacks import per_layer


_WHERE = "`quax_tangents.optax.layerwise`"


class _Rows(NamedTuple):
    """An array cut along axis 0 into `layers` slices of `size` rows: slice `i`
    starts at `min(i * size, total - size)`, so where `layers * size > total` the
    last slices overlap the ones before, and only their fresh rows are written."""

    total: int
    size: int
    layers: int

    @classmethod
    def of(cls, total: int, layers: int) -> "_Rows":
        return cls(total, -(-total // layers), layers)

    @property
    def even(self) -> bool:
        return self.size * self.layers == self.total

    def start(self, layer: Any) -> Any:
        return jnp.minimum(layer * self.size, self.total - self.size)

    def read(self, x: Any, layer: Any) -> Any:
        return lax.dynamic_slice_in_dim(x, self.start(layer), self.size, axis=0)

    def write(self, buffer: Any, value: Any, layer: Any) -> Any:
        # Under explicit mesh axes a slice is typed as its buffer (a loop's carry
        # may not change type): the update of one layer follows the stack's layout.
        value = like(value, buffer)
        start = self.start(layer)
        if not self.even:
            fresh = start + jnp.arange(self.size) >= layer * self.size
            fresh = fresh.reshape((self.size,) + (1,) * (value.ndim - 1))
            old = lax.dynamic_slice_in_dim(buffer, start, self.size, axis=0)
            value = jnp.where(fresh, value, old)
        return lax.dynamic_update_slice_in_dim(buffer, value, start, axis=0)


def _rows(x: Any, is_cut: bool, layers: int) -> _Rows | None:
    return _Rows.of(jnp.shape(x)[0], layers) if is_cut else None


def layerwise(
    tx: optax.GradientTransformation, *, layers: int, split: Filter = None
) -> optax.GradientTransformationExtraArgs:
    """Runs `tx` on one layer's slice of the stacked leaves at a time.

    A model whose blocks are stacked (`equinox.filter_vmap`, then `lax.scan`) has
    leaves of shape `(layers, ...)`. `tx.update` on the whole tree computes every
    layer's intermediates at once: with [`quax_tangents.optax.quantized_state`][]
    that is every layer's optimiser state decoded to float32, several times the
    8-bit state. `layerwise(tx, layers=L)` instead runs `tx.update` `L` times in a
    `lax.fori_loop`, on the `i`-th slice `x[i * k:(i + 1) * k]` (`k = ceil(x.shape[0]
    / L)`) of every *split* leaf of the gradients, the parameters and the state,
    and writes that slice of the new state and of the updates in place. The
    intermediates are one slice's size; the result is the same as `tx`'s. (Where
    `L` does not divide a leaf's leading dim, its last slice starts earlier and
    overlaps the one before; the overlapping rows keep what that one wrote.)

    This is only right when `tx` treats the slices of a split leaf independently:
    elementwise transformations (Adam and the other `scale_by_*`),
    [`quax_tangents.optax.projected`][] on stacked leaves (each layer has its own
    projector) and [`quax_tangents.optax.quantized_state`][] around either. Not
    `optax.clip_by_global_norm` or anything else that reduces over a whole leaf or
    over leaves.

    Leaves that are not split (a matrix that `projected` projects as a whole, a
    `SparseRows` gradient, a vector, a leaf with fewer than `layers` rows) go whole
    into every iteration, computed from the state as it was before the step, so
    every iteration gives the same result for them and the last is kept: correct,
    at the cost of computing them `layers` times. State leaves that are not per
    leaf (step counts) are treated the same way. The state has the structure
    `tx.init(params)` gives; `layerwise` only changes how the update is computed.

    A split leaf's updates that are the
    gradient's own arrays (the projector of a `LowRank` update) are not copied.
    With `quantized_state`'s stochastic rounding, each slice draws its rounding
    noise as if it were the whole leaf: every entry is still rounded without bias,
    but not with the noise `tx` alone would draw.

    **Arguments:**

    - `tx`: the transformation to run per slice.
    - `layers`: the number of slices (the iterations of the loop): the number of
        layers of a stacked model.
    - `split`: which parameter leaves are split, in any form `optax.masked` takes.
        `None` (the default) splits every leaf of 2 dims or more with at least
        `layers` rows (a vector, a final norm's scale say, goes whole), except
        those whose slices `tx` would not update independently: a leaf that
        [`quax_tangents.optax.projected`][] projects as one matrix (no stack dim),
        and a `SparseRows` or unstacked `LowRank` gradient.

    **Returns:**

    A transformation with `tx`'s state and updates.
    """
    layers = check_int("layers", layers, 1)
    if not isinstance(tx, optax.GradientTransformation):
        raise TypeError(
            f"`tx` must be an optax.GradientTransformation, got {type(tx).__name__}."
        )
    tx = optax.with_extra_args_support(tx)

    def update(
        updates: PyTree, state: Any, params: PyTree = None, **extra: Any
    ) -> tuple[PyTree, Any]:
        grads, treedef = jtu.tree_flatten(updates, is_leaf=is_compressed)
        cut = _leaves_to_cut(grads, treedef, params, state, split, layers)
        param_leaves = None if params is None else treedef.flatten_up_to(params)
        with per_layer():
            return _Loop(
                tx,
                layers,
                grads,
                treedef,
                cut,
                state,
                param_leaves,
                extra,
                split is not None,
            ).run()

    return optax.GradientTransformationExtraArgs(tx.init, update)


# ---------------------------------------------------------------------------------------
# Which leaves are split


def _can_cut(grad: Any) -> bool:
    if isinstance(grad, SparseRows):
        return False
    if isinstance(grad, LowRank):
        return grad.batch_ndim >= 1
    return not is_compressed(grad)


def _projected_whole(state: Any, treedef: Any) -> list[bool]:
    """Per leaf, whether a `ProjectedState` in `state` projects it as one matrix
    (no stack dims): its rows are not independent."""
    whole = [False] * treedef.num_leaves
    for node in jtu.tree_leaves(state, is_leaf=lambda x: isinstance(x, ProjectedState)):
        if not isinstance(node, ProjectedState) or node.plan is None:
            continue
        try:
            plans = treedef.flatten_up_to(node.plan)
        except (ValueError, TypeError):
            continue
        for index, plan in enumerate(plans):
            if plan is not None and plan.kind == "project" and plan.batch_ndim == 0:
                whole[index] = True
    return whole


def _leaves_to_cut(
    grads: list, treedef: Any, params: Any, state: Any, split: Filter, layers: int
) -> list[bool]:
    shaped = jtu.tree_unflatten(
        treedef, [jax.ShapeDtypeStruct(jnp.shape(g), g.dtype) for g in grads]
    )
    flags = mask_flags(split, shaped if params is None else params, "split")
    whole = _projected_whole(state, treedef)
    cut = []
    for index, grad in enumerate(grads):
        shape = jnp.shape(grad)
        reasons = []
        if len(shape) == 0 or shape[0] < layers:
            reasons.append(f"it has fewer than layers={layers} rows")
        if not _can_cut(grad):
            reasons.append(
                f"a {type(grad).__name__} gradient cannot be cut along its leading axis"
            )
        if whole[index]:
            reasons.append("`projected` projects it as one matrix (no stack dim)")
        if flags is None:
            # A vector has no layers: cutting it bounds nothing worth the cost, and a
            # slice below `quantized_state`'s block is stored another way, which
            # costs one more abstract `tx.init` per cut leaf to find (two fifths of
            # tracing the 1B step, whose final norm is such a vector).
            cut.append(not reasons and len(shape) >= 2)
            continue
        if flags[index] and reasons:
            raise ValueError(
                f"{_WHERE}: `split` selects the leaf "
                f"{jtu.keystr(_path(treedef, index)) or 'the root'} of shape "
                f"{list(shape)}, but {'; '.join(reasons)}. Leave it out of `split`; "
                "it is then updated whole."
            )
        cut.append(flags[index])
    return cut


def _path(treedef: Any, index: int) -> tuple:
    numbered = jtu.tree_unflatten(treedef, list(range(treedef.num_leaves)))
    return jtu.tree_flatten_with_path(numbered)[0][index][0]


# ---------------------------------------------------------------------------------------
# The loop


def _abstract(x: Any) -> jax.ShapeDtypeStruct:
    return jax.ShapeDtypeStruct(jnp.shape(x), x.dtype)


class _Loop:
    """One `layerwise` update: the flat inputs, how each is cut, and the loop."""

    def __init__(
        self,
        tx: Any,
        layers: int,
        grads: list,
        treedef: Any,
        cut: list[bool],
        state: Any,
        param_leaves: list | None,
        extra: dict,
        user_split: bool,
    ):
        self.tx, self.layers, self.treedef, self.extra = tx, layers, treedef, extra
        self.grads, self.state, self.param_leaves = grads, state, param_leaves
        self.arrays, self.arrays_def = jtu.tree_flatten(grads)
        self.array_rows = [
            _rows(array, is_cut, layers)
            for grad, is_cut in zip(grads, cut)
            for array in jtu.tree_leaves(grad)
        ]
        shapes = [_abstract(g) for g in (param_leaves or grads)]
        self.param_rows = [_rows(x, c, layers) for x, c in zip(shapes, cut)]
        self.slices = [
            x if r is None else jax.ShapeDtypeStruct((r.size, *x.shape[1:]), x.dtype)
            for x, r in zip(shapes, self.param_rows)
        ]
        self.shapes, self.cut, self.user_split = shapes, list(cut), user_split
        self._state_layout()

    def _state_layout(self) -> None:
        """Per state leaf, its rows if it is cut (one slice's state has it with
        `ceil(rows / layers)` rows), `None` if it goes whole (same shape)."""
        self.state_leaves, self.state_def = jtu.tree_flatten(self.state)
        one_leaves = self._slice_state()
        if len(one_leaves) != len(self.state_leaves):
            # A transformation may store a small leaf differently (`quantized_state`
            # keeps leaves under a block as they are): such leaves go whole.
            for index in range(len(self.cut)):
                if self.cut[index] and not self._same_structure_cutting(index):
                    self._uncut(index)
            one_leaves = self._slice_state()
        if len(one_leaves) != len(self.state_leaves):
            raise ValueError(
                f"{_WHERE}: the state of one slice has {len(one_leaves)} leaves and the "
                f"state given has {len(self.state_leaves)}: `tx`'s state must have the "
                "same structure for a slice as for the whole parameters."
            )
        self.state_rows = []
        for leaf, piece in zip(self.state_leaves, one_leaves):
            shape, part = tuple(jnp.shape(leaf)), tuple(piece.shape)
            if shape == part:
                self.state_rows.append(None)
                continue
            rows = _Rows.of(shape[0], self.layers) if shape else None
            if rows is None or part != (rows.size, *shape[1:]):
                raise ValueError(
                    f"{_WHERE}: a state leaf of shape {list(shape)} is {list(part)} for "
                    f"one of {self.layers} slices, which is neither the whole leaf nor "
                    "a slice of its leading axis: `tx` does not update the slices "
                    "independently."
                )
            self.state_rows.append(rows)

    def _slice_state(self, slices: list | None = None) -> list:
        slices = self.slices if slices is None else slices
        one = jax.eval_shape(self.tx.init, jtu.tree_unflatten(self.treedef, slices))
        one_leaves, self.one_def = jtu.tree_flatten(one)
        return one_leaves

    def _same_structure_cutting(self, index: int) -> bool:
        alone = [
            x if k == index else w
            for k, (x, w) in enumerate(zip(self.slices, self.shapes))
        ]
        return len(self._slice_state(alone)) == len(self.state_leaves)

    def _uncut(self, index: int) -> None:
        if self.user_split:
            raise ValueError(
                f"{_WHERE}: `split` selects the leaf "
                f"{jtu.keystr(_path(self.treedef, index)) or 'the root'}, whose "
                "state has another structure for one slice (too small to be stored "
                "the same way, say). Leave it out of `split`."
            )
        self.cut[index] = False
        self.slices[index] = self.shapes[index]
        self.param_rows[index] = None
        grad_arrays = [len(jtu.tree_leaves(g)) for g in self.grads]
        first = sum(grad_arrays[:index])
        for k in range(first, first + grad_arrays[index]):
            self.array_rows[k] = None

    def read(self, layer: Any, sources: dict) -> tuple[list, list | None]:
        """Slice `layer` of the gradients' flat arrays and of the parameters' leaves.
        `sources` maps a gradient array to the buffer it is read from instead (the
        updates' buffer it is written over)."""
        g = [
            a
            if r is None
            else r.read(sources[k], layer)
            if k in sources
            else r.read(a, layer)
            for k, (a, r) in enumerate(zip(self.arrays, self.array_rows))
        ]
        if self.param_leaves is None:
            return g, None
        return g, [
            x if r is None else r.read(x, layer)
            for x, r in zip(self.param_leaves, self.param_rows)
        ]

    def update(
        self, g: list, param_leaves: list | None, state_leaves: list
    ) -> tuple[list, PyTree]:
        """`tx.update` on one slice: the new state's flat arrays and the updates."""
        p = None
        if param_leaves is not None:
            p = jtu.tree_unflatten(self.treedef, param_leaves)
        out, new_state = self.tx.update(
            jtu.tree_unflatten(self.treedef, jtu.tree_unflatten(self.arrays_def, g)),
            jtu.tree_unflatten(self.one_def, state_leaves),
            p,
            **self.extra,
        )
        return jtu.tree_leaves(new_state), out

    def state_slice(self, layer: Any, carried: list) -> list:
        # Leaves passed whole are read as they were before the step, so that every
        # iteration computes the same new value for them; leaves that the gradient
        # passes through are not carried, and read from before the step too (a
        # slice is only written in its own iteration, so both give the same).
        return [
            old if r is None else r.read(old if x is None else x, layer)
            for x, old, r in zip(carried, self.state_leaves, self.state_rows)
        ]

    def _outputs(self) -> None:
        """The updates' flat shapes for the whole tree, how each is cut, and which
        are a gradient's own arrays (not carried) or guards (made afresh)."""
        passthrough: list[Any] = []
        state_passthrough: list[Any] = []

        def probe(g: list, param_leaves: list | None, state_leaves: list) -> tuple:
            state, out = self.update(g, param_leaves, state_leaves)
            ids = {id(x): k for k, x in enumerate(g)}
            passthrough.extend(ids.get(id(x)) for x in jtu.tree_leaves(out))
            state_passthrough.extend(ids.get(id(x)) for x in state)
            return state, out

        # One slice's update is traced once, here (where any densification is
        # counted): the loop's body replays it, and its shapes give the loop's.
        state_leaves = self.state_slice(0, self.state_leaves)
        self.replay, (_, out) = traced(probe, *self.read(0, {}), state_leaves)
        one_out, self.out_def = jtu.tree_flatten(out)
        self.full_out = self._whole_outputs(one_out)
        out_cut = _output_cuts(self.out_def, self.treedef, self.cut)
        self.out_rows = [
            _rows(f, c, self.layers) for f, c in zip(self.full_out, out_cut)
        ]
        self.passthrough = [
            "guard" if is_guard(o) else p for o, p in zip(one_out, passthrough)
        ]
        self.state_passthrough = [
            p if p is not None and self._same_array(old, r, p) else None
            for old, r, p in zip(self.state_leaves, self.state_rows, state_passthrough)
        ]

    def _whole_outputs(self, one_out: list) -> list:
        """The updates' flat shapes for the whole tree, from one slice's (not from
        `tx.update` traced on the whole tree, which would cost as much as the loop's
        own trace): a split leaf's arrays are its slice's with the leaf's rows."""
        marks = jtu.tree_unflatten(self.out_def, list(range(len(one_out))))
        rows_of: list[_Rows | None] = [None] * len(one_out)
        for leaf, rows in zip(self.treedef.flatten_up_to(marks), self.param_rows):
            for index in jtu.tree_leaves(leaf):
                rows_of[index] = rows
        whole = []
        for part, rows in zip(one_out, rows_of):
            if rows is None:
                whole.append(part)
                continue
            if not part.shape or part.shape[0] != rows.size:
                raise ValueError(
                    f"{_WHERE}: an update of one of {self.layers} slices has shape "
                    f"{list(part.shape)}, not {rows.size} rows of its leaf's "
                    f"{rows.total}: `tx` does not update the slices independently."
                )
            whole.append(
                jax.ShapeDtypeStruct((rows.total, *part.shape[1:]), part.dtype)
            )
        return whole

    def _same_array(self, state_leaf: Any, rows: Any, k: int) -> bool:
        """Whether gradient array `k` can stand for a new state leaf whose slices
        are its slices: same shape, dtype and cut (a `projected` state's projector
        is the gradient's, so that the old one is never read, nor carried)."""
        a = self.arrays[k]
        return (
            rows == self.array_rows[k]
            and tuple(jnp.shape(a)) == tuple(jnp.shape(state_leaf))
            and jnp.dtype(a.dtype) == jnp.dtype(state_leaf.dtype)
        )

    def _pairs(self) -> dict[int, int]:
        """Update arrays written over the gradient array they replace (same leaf,
        shape and dtype, split, not passed through): each slice of the gradient
        is read before its update is written there, so the two share a buffer."""
        # A gradient array that an update or the new state passes through is
        # returned as it is, so it cannot also hold an update.
        taken = {
            p
            for p in [*self.passthrough, *self.state_passthrough]
            if isinstance(p, int)
        }
        leaf_of_grad = [
            k for k, grad in enumerate(self.grads) for _ in jtu.tree_leaves(grad)
        ]
        marks = jtu.tree_unflatten(self.out_def, list(range(len(self.full_out))))
        leaf_of_out = {
            index: k
            for k, leaf in enumerate(self.treedef.flatten_up_to(marks))
            for index in jtu.tree_leaves(leaf)
        }
        pairs = {}
        for o, (f, r, p) in enumerate(
            zip(self.full_out, self.out_rows, self.passthrough)
        ):
            if r is None or p is not None:
                continue
            for g, (a, rows) in enumerate(zip(self.arrays, self.array_rows)):
                if (
                    g not in taken
                    and rows is not None
                    and leaf_of_grad[g] == leaf_of_out[o]
                    and tuple(jnp.shape(a)) == tuple(f.shape)
                    and jnp.dtype(a.dtype) == jnp.dtype(f.dtype)
                ):
                    pairs[o] = g
                    taken.add(g)
                    break
        return pairs

    def run(self) -> tuple[PyTree, Any]:
        self._outputs()
        pairs = self._pairs()
        initial_state = [
            None if p is not None else x
            for x, p in zip(self.state_leaves, self.state_passthrough)
        ]
        initial_out = [
            None
            if p is not None
            else self.arrays[pairs[o]]
            if o in pairs
            else jnp.zeros(f.shape, f.dtype)
            for o, (f, p) in enumerate(zip(self.full_out, self.passthrough))
        ]

        def body(layer: Any, carry: tuple) -> tuple:
            carried_state, carried_out = carry
            sources = {g: carried_out[o] for o, g in pairs.items()}
            state_leaves = self.state_slice(layer, carried_state)
            new_state, out = self.replay(*self.read(layer, sources), state_leaves)
            out = jtu.tree_leaves(out)
            carried_state = [
                None
                if p is not None
                else like(n, c)
                if r is None
                else r.write(c, n, layer)
                for c, n, r, p in zip(
                    carried_state, new_state, self.state_rows, self.state_passthrough
                )
            ]
            carried_out = [
                None
                if p is not None
                else (like(o, c) if r is None else r.write(c, o, layer))
                for c, o, r, p in zip(carried_out, out, self.out_rows, self.passthrough)
            ]
            return carried_state, carried_out

        final_state, final_out = lax.fori_loop(
            0, self.layers, body, (initial_state, initial_out)
        )
        final_state = [
            self.arrays[p] if p is not None else x
            for x, p in zip(final_state, self.state_passthrough)
        ]
        final_out = [
            guard(f.shape[:-2])
            if p == "guard"
            else self.arrays[cast(int, p)]
            if p is not None
            else x
            for x, f, p in zip(final_out, self.full_out, self.passthrough)
        ]
        return (
            jtu.tree_unflatten(self.out_def, final_out),
            jtu.tree_unflatten(self.state_def, final_state),
        )


def _output_cuts(out_def: Any, treedef: Any, cut: list[bool]) -> list[bool]:
    """Whether each flat update array is one slice of a split leaf: the updates have
    the gradients' structure, so a leaf's arrays are split where its gradient is."""
    marks = jtu.tree_unflatten(out_def, list(range(out_def.num_leaves)))
    per_leaf = treedef.flatten_up_to(marks)
    flags = [False] * out_def.num_leaves
    for leaf, is_cut in zip(per_leaf, cut):
        for index in jtu.tree_leaves(leaf):
            flags[index] = is_cut
    return flags
