"""Forward gradients: unbiased gradient estimates from forward mode alone.

After Baydin et al. (2022), "Gradients without Backpropagation". For a random direction
`v` with `E[v v^T] = I`, the directional derivative `s = grad f . v` comes out of one
JVP, and `g = s v` is an unbiased estimate of `grad f`: `E[g] = E[v v^T] grad f`.

Here `v` is drawn directly as a compressed value, so the JVP pushes it through the
network from its factors (or entries) and the estimate `s v` is a scalar times `v`,
which stays compressed. With low-rank or sparse directions no weight-sized direction
is ever built.
"""

import dataclasses
import functools
import math
from collections.abc import Callable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import quax
from jaxtyping import Array, Float, PRNGKeyArray, PyTree, Scalar

from .._core import _validate
from .._core._base import materialise_values
from .._core._deprecation import warn_deprecated
from .._differentiable import split_structures
from .._types.lowrank import LowRank
from .._types.sparse import Sparse
from ._ad import jvp


class LowRankDirections(eqx.Module):
    """Low-rank directions for [`quax_tangents.forward_grad`][], the default: a leaf
    of shape `(..., m, n)` gets the `LowRank` direction `sum_i a_i b_i^T /
    sqrt(rank)` with standard normal `a_i` (length `m`) and `b_i` (length `n`),
    independently per leading index.

    Nothing is normalised or orthonormalised: that would break unbiasedness. For a
    single `m x n` leaf the expected squared error is
    `(((m + 2)(n + 2) + (rank - 1)(m n + 2)) / rank - 1) ||grad f||^2`: for
    `rank=1`, `(m + 2)(n + 2) - 1`, close to the dense Gaussian's `m n + 1`. A leaf
    whose factors would be no smaller than it, `rank (m + n) >= m n` (a row or a
    column, say), gets a dense Gaussian direction instead.

    **Arguments:**

    - `rank`: the rank of each direction, at least 1.
    """

    # Static: the rank sets the factors' shapes (a pytree leaf would be traced).
    rank: int = eqx.field(default=1, static=True)

    def __check_init__(self) -> None:
        _validate.check_positive_int("rank", self.rank)


class GaussianDirections(eqx.Module):
    """Dense standard normal directions for [`quax_tangents.forward_grad`][], one per
    leaf: expected squared error `(d + 1) ||grad f||^2` over all `d` parameters."""


class SparseDirections(eqx.Module):
    """Sparse directions for [`quax_tangents.forward_grad`][]: a leaf of `n` entries
    gets a `Sparse` direction with `k` entries of random sign, one drawn uniformly
    from each of `k` equal contiguous blocks of the flattened leaf (block sizes
    differ by at most one when `k` does not divide `n`) and scaled by the square
    root of its block size, `sqrt(n/k)` when the blocks are equal: an entry of a
    block of `size` entries is picked with probability `1/size` and scaled by
    `sqrt(size)`.

    Drawing by blocks avoids the `n`-sized permutation that a uniformly random
    subset needs. Expected squared error `(n - 1) ||grad f||^2` for a single leaf,
    whatever `k`: a smaller `k` is cheaper at the same variance.

    **Arguments:**

    - `k`: the entries of each direction: an int count (at most the leaf's size) or
        a float fraction in `(0, 1]` of the leaf's size (at least 1).
    """

    # Static: `k` sets the entries' count (a pytree leaf would be traced).
    k: int | float = eqx.field(default=0.01, static=True)

    def __check_init__(self) -> None:
        _check_k(self.k)


Directions = LowRankDirections | GaussianDirections | SparseDirections
_DIRECTION_TYPES = (LowRankDirections, GaussianDirections, SparseDirections)
_DIRECTIONS = (
    "`qt.LowRankDirections(rank=...)`, `qt.GaussianDirections()` or "
    "`qt.SparseDirections(k=...)`"
)


class ForwardGradInfo(eqx.Module):
    """What the forward pass measured besides the gradient estimate.

    **Arguments:**

    - `value`: `fn(params)`, the primal output of the JVP (free: no extra pass).
    - `directional_derivatives`: `grad f . v_i` for each direction `v_i`.
    """

    value: Scalar
    directional_derivatives: Float[Array, " num_directions"]

    @property
    def derivative_variance(self) -> Scalar:
        """The empirical variance (`ddof=1`) of the directional derivatives over the
        directions: NaN for a single direction. Every direction kind has
        `E[(grad f . v)^2] = ||grad f||^2`, so this spread, divided by the mean of the
        squares, says how noisy the directions are for this function."""
        return jnp.var(self.directional_derivatives, ddof=1)

    @property
    def squared_norm_estimate(self) -> Scalar:
        """`mean((grad f . v_i)^2)`, an unbiased estimate of `||grad f||^2` (for
        every direction kind, since `E[v v^T] = I`). With Gaussian directions in `d`
        dimensions the expected squared error of the averaged estimate is
        `(d + 1) ||grad f||^2 / num_directions`."""
        return jnp.mean(jnp.square(self.directional_derivatives))


def forward_grad(
    fn: Callable[[PyTree], Scalar],
    params: PyTree,
    key: PRNGKeyArray,
    *,
    directions: Directions | str = LowRankDirections(),  # noqa: B008 (immutable)
    num_directions: int = 1,
    return_info: bool = False,
    rank: int | None = None,
    k: int | float | None = None,
) -> PyTree | tuple[PyTree, ForwardGradInfo]:
    """The forward-gradient estimate `g = (grad f . v) v` of `grad fn(params)`, with
    `v` drawn as a compressed value (Baydin et al., 2022).

    Each direction costs one forward-mode JVP and no backward pass: all
    `num_directions` directions go through one `quax_tangents.jvp`, batched with
    `jax.vmap` (the primal is computed once). The directions are drawn so that
    `E[vec(v) vec(v)^T] = I`, which makes the estimate unbiased, `E[g] = grad f`,
    from one of three strategies (`directions`):
    [`quax_tangents.LowRankDirections`][] (the default),
    [`quax_tangents.GaussianDirections`][] and
    [`quax_tangents.SparseDirections`][].

    With every strategy, leaves with fewer than two dimensions (biases, scalars) get dense
    standard normal directions: they are small, and have no low-rank form.

    The estimate keeps each leaf's direction type: `s * v` of a `LowRank` is a
    `LowRank` (the scalar scales a factor). Several directions are averaged inside:
    `g = sum_i (s_i / num_directions) v_i`, whose `LowRank` leaves have rank
    `num_directions * rank` (the factors are concatenated) and whose `Sparse` leaves
    have `num_directions * k` entries. Past the `LowRank` rank budget (see
    `quax_tangents.rank_budget`) the sum densifies, or recompresses, which is lossy
    and biases the estimate.

    Generic optax transforms map over leaves, so hand them
    `quax_tangents.materialise(g)`, or use `quax_tangents.move` for a
    `@differentiable` model, which materialises each leaf as it adds it.

    The JVP's tangent stays compressed only as far as the rules allow: through a
    bias add or a nonlinearity it becomes a dense activation-sized array, recorded
    with the fallback policy (under the default `"warn"`, a `DensificationWarning`;
    `quax_tangents.fallback("silent")` only counts it).

    Call it under `jax.jit` (with `key` as an argument): eagerly every random draw and
    every rule dispatches on its own.

    **Arguments:**

    - `fn`: the scalar function, called as `fn(params)`. Data (inputs, labels) is
        closed over or partially applied. As in `quax_tangents.jvp`, it may not capture
        a compressed value in a closure.
    - `params`: a pytree of floating arrays, or a `@differentiable` model, whose
        differentiable fields are the parameters. Every leaf is differentiated:
        integer leaves are an error (close over them instead).
    - `key`: a PRNG key for the directions.
    - `directions`: `qt.LowRankDirections(rank=...)`, `qt.GaussianDirections()` or
        `qt.SparseDirections(k=...)`.
    - `num_directions`: how many directions to average, at least 1.
    - `return_info`: also return a `ForwardGradInfo` with `fn(params)` and the
        directional derivatives (and through it their empirical variance).
    - `rank`, `k`: deprecated spellings of `LowRankDirections(rank=...)` and
        `SparseDirections(k=...)`, as are the strings `"low_rank"`, `"gaussian"` and
        `"sparse"` for `directions`; each use warns.

    **Returns:**

    The estimate, with the structure of `params` (a `Model.Tangent` for a
    `@differentiable` model), or `(estimate, info)` with `return_info=True`.
    """
    directions = _strategy(directions, rank, k)
    _validate.check_key("key", key)
    num_directions = _validate.check_positive_int("num_directions", num_directions)
    view = split_structures((params,))[0][0]
    _check_params(view)
    leaves, treedef = jtu.tree_flatten(view)
    recipes = [
        _recipe(directions, jnp.shape(leaf), jnp.result_type(leaf)) for leaf in leaves
    ]

    def one_direction(key: PRNGKeyArray) -> tuple[Scalar, Scalar, PyTree]:
        direction = _draw_tree(recipes, treedef, key)
        value, derivative = jvp(fn, (params,), (direction,))[:2]
        _check_scalar_output(value)
        # A scalar tangent may still be a compressed value (a `Sparse` of shape ()).
        return value, materialise_values(derivative), direction

    keys = jax.random.split(key, num_directions)
    values, derivatives, drawn = jax.vmap(one_direction)(keys)
    estimate = jtu.tree_map(
        lambda v: _weighted_sum(derivatives / num_directions, v),
        drawn,
        is_leaf=_is_value,
    )
    if return_info:
        return estimate, ForwardGradInfo(values[0], derivatives)
    return estimate


# ---------------------------------------------------------------------------------------
# Input checks


_STRATEGY_OF_NAME = {
    "low_rank": LowRankDirections,
    "gaussian": GaussianDirections,
    "sparse": SparseDirections,
}


def _strategy(directions: Any, rank: Any, k: Any) -> Directions:
    """`directions` as a strategy, after a warning for each deprecated spelling
    (a name for `directions`, `rank=`, `k=`)."""
    _validate.check_not_a_class("directions", directions, _DIRECTION_TYPES, "qt.")
    old = []
    if isinstance(directions, str) and directions in _STRATEGY_OF_NAME:
        old.append(f"directions={directions!r}")
        directions = _STRATEGY_OF_NAME[directions]()
    if not isinstance(directions, _DIRECTION_TYPES):
        raise TypeError(f"`directions` must be {_DIRECTIONS}, got {directions!r}.")
    for name, value, kind in (
        ("rank", rank, LowRankDirections),
        ("k", k, SparseDirections),
    ):
        if value is None:
            continue
        if not isinstance(directions, kind):
            raise ValueError(
                f"`{name}` sets `{kind.__name__}`'s `{name}`, but `directions` is "
                f"{directions!r}; drop `{name}`."
            )
        old.append(f"{name}={value!r}")
        directions = kind(**{name: value})
    if old:
        warn_deprecated(
            f"forward_grad({', '.join(old)})",
            f"forward_grad(directions=qt.{directions!r})",
            stacklevel=4,
        )
    return directions


def _check_k(k: Any) -> None:
    if isinstance(k, (float, np.floating)):
        if not 0.0 < k <= 1.0:
            raise ValueError(
                f"`k` as a float is the fraction of each leaf's entries and must be "
                f"in (0, 1], got {k!r}; pass an int for a count."
            )
        return
    _validate.check_positive_int("k", k)


def _check_params(view: PyTree) -> None:
    leaves = jtu.tree_leaves_with_path(view, is_leaf=_is_value)
    if not leaves:
        raise ValueError("`params` has no array leaves: there is nothing to estimate.")
    for path, leaf in leaves:
        where = jtu.keystr(path) or "(the root)"
        if _is_value(leaf):
            raise TypeError(
                f"`params` leaf {where} is a {type(leaf).__name__}; parameters must "
                "be dense arrays (the directions are the compressed values)."
            )
        if not hasattr(leaf, "dtype") and not isinstance(leaf, (float, int)):
            raise TypeError(
                f"`params` leaf {where} is a {type(leaf).__name__}, not an array. "
                "Separate the arrays first, e.g. with `equinox.partition`."
            )
        dtype = jnp.result_type(leaf)
        if not jnp.issubdtype(dtype, jnp.floating):
            raise TypeError(
                f"`params` leaf {where} has dtype {dtype}. Every leaf of `params` is "
                "differentiated, so each must be a real floating array; close over "
                "integer data (or partially apply `fn` to it) instead."
            )


def _check_scalar_output(value: Any) -> None:
    if jnp.ndim(value) != 0 or not jnp.issubdtype(jnp.result_type(value), jnp.floating):
        raise TypeError(
            "`forward_grad` needs a function with a real scalar output, got "
            f"{jnp.result_type(value)}{list(jnp.shape(value))}."
        )


def _is_value(x: Any) -> bool:
    return isinstance(x, quax.Value)


# ---------------------------------------------------------------------------------------
# Directions: each has E[vec(v) vec(v)^T] = I


@dataclasses.dataclass(frozen=True)
class _Recipe:
    """How one leaf's direction is built from standard normals and integers, which
    `_draw_tree` draws for all leaves at once where it can (see `_OWN_DRAW`)."""

    dtype: Any  # the leaf's dtype
    normals: int  # how many standard normals the leaf consumes
    block_sizes: np.ndarray  # `"sparse"` blocks: one integer in [0, 2 size) each
    build: Callable[[Array, Array], Any]  # (its normals, its integers) -> direction


_NO_BLOCKS = np.zeros(0, np.int64)
# Sparse draws are integers in [0, 2 * block size), which must fit in int32.
_MAX_BLOCK = 2**30


def _gaussian(shape: tuple[int, ...], dtype: Any) -> _Recipe:
    def build(normals: Array, _: Array) -> Array:
        return normals.reshape(shape).astype(dtype)

    return _Recipe(dtype, math.prod(shape), _NO_BLOCKS, build)


def _low_rank(shape: tuple[int, ...], dtype: Any, rank: int) -> _Recipe:
    # With A (m x r) and B (n x r) standard normal, A B^T / sqrt(r) is a sum of r
    # independent rank-1 directions a b^T, each with identity second moment; the
    # 1/sqrt(r) keeps the sum's second moment at the identity.
    *batch, m, n = shape
    left_shape, right_shape = (*batch, m, rank), (*batch, n, rank)
    split = math.prod(left_shape)

    def build(normals: Array, _: Array) -> LowRank:
        left = normals[:split].reshape(left_shape) * rank**-0.5
        right = normals[split:].reshape(right_shape)
        return LowRank(left.astype(dtype), right.astype(dtype))

    return _Recipe(dtype, split + math.prod(right_shape), _NO_BLOCKS, build)


def _sparse_count(k: int | float, size: int) -> int:
    if isinstance(k, (float, np.floating)):
        return max(1, round(float(k) * size))
    return min(int(k), size)


def _sparse(shape: tuple[int, ...], dtype: Any, k: int | float) -> _Recipe:
    # One entry per block of the flattened leaf: entry j of block b is picked with
    # probability 1/size_b and scaled by sqrt(size_b), so E[v_j^2] = 1, and the
    # independent signs make E[v_i v_j] = 0 for i != j.
    size = math.prod(shape)
    count = _sparse_count(k, size)
    starts = np.arange(count + 1, dtype=np.int64) * size // count
    sizes = np.diff(starts)
    if sizes.max() >= _MAX_BLOCK:
        raise ValueError(
            f"A leaf of shape {shape} with k={count} has blocks of {sizes.max()} "
            f"entries; sparse directions need blocks under {_MAX_BLOCK}: raise `k`."
        )

    def build(_: Array, draws: Array) -> Sparse:
        # A uniform integer in [0, 2 size) is a uniform offset (draws // 2) and an
        # independent fair sign bit (draws % 2).
        indices = jnp.asarray(starts[:-1], jnp.int32) + draws // 2
        signs = 1 - 2 * (draws % 2)
        values = signs.astype(dtype) * jnp.asarray(np.sqrt(sizes), dtype)
        return Sparse(indices, values, shape)

    return _Recipe(dtype, 0, sizes, build)


def _recipe(directions: Directions, shape: tuple[int, ...], dtype: Any) -> _Recipe:
    """The recipe for one leaf; vectors and scalars are always dense Gaussian."""
    if isinstance(directions, GaussianDirections) or len(shape) < 2:
        return _gaussian(shape, dtype)
    if isinstance(directions, LowRankDirections):
        m, n = shape[-2:]
        if directions.rank * (m + n) >= m * n:  # factors no smaller than the matrix
            return _gaussian(shape, dtype)
        return _low_rank(shape, dtype, directions.rank)
    return _sparse(shape, dtype, directions.k)


# A leaf that needs at least this many normals draws them on its own. Sharing one draw
# compiles faster (XLA compiles a random generator per call site: threefry, on CPU,
# in about a second each), but slicing a large shared draw costs copies and generator
# scratch of the draw's size, about three times a dense direction's memory.
_OWN_DRAW = 2**16


def _draw_tree(recipes: list[_Recipe], treedef: Any, key: PRNGKeyArray) -> PyTree:
    """Independent directions for all leaves: one shared draw of normals for the
    small ones, one each for the large ones, and one shared draw of integers."""
    key_shared, key_integer, *leaf_keys = jax.random.split(key, 2 + len(recipes))
    shared = [r for r in recipes if r.normals < _OWN_DRAW]
    shared_normals = _normals(
        key_shared, sum(r.normals for r in shared), _work_dtype(shared)
    )
    block_sizes = np.concatenate([r.block_sizes for r in recipes])
    draws = jnp.zeros(0, jnp.int32)
    if block_sizes.size:
        draws = jax.random.randint(
            key_integer, block_sizes.shape, 0, (2 * block_sizes).astype(np.int32)
        )
    drawn, normal_at, draw_at = [], 0, 0
    for r, leaf_key in zip(recipes, leaf_keys):
        if r.normals >= _OWN_DRAW:
            normals = _normals(leaf_key, r.normals, _work_dtype([r]))
        else:
            normals = shared_normals[normal_at : normal_at + r.normals]
            normal_at += r.normals
        blocks = len(r.block_sizes)
        drawn.append(r.build(normals, draws[draw_at : draw_at + blocks]))
        draw_at += blocks
    return jtu.tree_unflatten(treedef, drawn)


def _work_dtype(recipes: list[_Recipe]) -> Any:
    """float32, or wider for wider leaves; half-precision leaves round the normals."""
    return functools.reduce(
        jnp.promote_types, [r.dtype for r in recipes], jnp.dtype(jnp.float32)
    )


def _normals(key: PRNGKeyArray, count: int, dtype: Any) -> Array:
    if not count:
        return jnp.zeros(0, dtype)
    return jax.random.normal(key, (count,), dtype)


# ---------------------------------------------------------------------------------------
# Averaging


def _weighted_sum(weights: Float[Array, " n"], stacked: Any) -> Any:
    """`sum_i weights[i] * stacked[i]` over the leading (direction) axis.

    Through the rules, a compressed leaf stays compressed: the scalar weights scale
    one factor (or the values), and the sum concatenates factors (or entries).
    """

    def combine(weights: Array, stacked: Array) -> Array:
        shaped = weights.reshape((-1,) + (1,) * (stacked.ndim - 1))
        return jnp.sum(shaped.astype(stacked.dtype) * stacked, axis=0)

    return quax.quaxify(combine)(weights, stacked)
