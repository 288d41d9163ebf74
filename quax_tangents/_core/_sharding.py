"""Linear algebra that runs on operands sharded with explicit mesh axes.

Under a mesh whose axes are `jax.sharding.AxisType.Explicit`, shardings are part of
the types, and three things the projection code needs refuse sharded operands in
jax 0.10.2:

- `jnp.linalg.qr` (and `svd`) of a matrix sharded on a non-batch dim raises
    `ShardingTypeError: Input 0 to qr must be unsharded on non-batch dimensions`;
- a product whose contracting dim is sharded needs `out_sharding=`;
- `lax.cond`/`select` needs its cases to share a sharding.

`orthonormal_columns` is therefore built from products and factorisations of small
`w x w` Gram matrices only (which are replicated after the reduction over the sharded
rows), and `matmul` names the output sharding. Without explicit axes (no mesh, `Auto`
axes, or inside `shard_map`) both are the plain computations.
"""

from typing import Any

import jax
import jax.core
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P
from jaxtyping import Array, Float

from ._eigh import symmetric_eigh
from ._row_blocks import exact_gram, exact_matmul


def explicit_axes() -> bool:
    """Whether the current mesh has an `Explicit` axis (shardings are types)."""
    mesh = jax.sharding.get_abstract_mesh()
    return not mesh.empty and bool(mesh._any_axis_explicit)


def on_current_mesh(x: Array) -> Array:
    """`x` typed on the current mesh, replicated, where it is typed on no mesh (an
    array put on one device before `jax.set_mesh`: weights made before the mesh,
    say) and the mesh has explicit axes; `x` itself otherwise. What is computed
    under such a mesh is typed on it (`jnp.zeros_like` included), and a loop's carry
    or an in-place update refuses to mix the two."""
    if not explicit_axes():
        return x
    mesh = getattr(getattr(jax.typeof(x), "sharding", None), "mesh", None)
    if mesh is None or not mesh.empty:
        return x
    return jax.sharding.reshard(x, P(*(None,) * jnp.ndim(x)))


def spec_entries(x: Any) -> tuple:
    """The entries of `x`'s sharding spec, one per dim (`None` where unsharded or
    when shardings are not types)."""
    ndim = jnp.ndim(x)
    if not explicit_axes():
        return (None,) * ndim
    spec = getattr(getattr(jax.typeof(x), "sharding", None), "spec", None)
    if spec is None:
        return (None,) * ndim
    entries = tuple(spec)
    return entries + (None,) * (ndim - len(entries))


def transposed_type(aval: Any, transposed: bool) -> Any:
    """The type of a matrix (`aval`) or of its transpose: shape and sharding swapped,
    varying mesh axes kept."""
    if not transposed:
        return aval
    sharding = getattr(aval, "sharding", None)
    spec = getattr(sharding, "spec", None)
    if sharding is None or spec is None:
        return aval.update(shape=aval.shape[::-1])
    entries = tuple(spec) + (None,) * (aval.ndim - len(spec))
    return aval.update(
        shape=aval.shape[::-1], sharding=sharding.update(spec=P(*entries[::-1]))
    )


def varying_axes(x: Any) -> frozenset:
    """The mesh axes `x` varies over, as `check_vma` types it (empty elsewhere)."""
    aval = x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x)
    return frozenset(getattr(getattr(aval, "mat", None), "varying", ()))


def varying_type(shape: tuple, dtype: Any, *operands: Any) -> Any:
    """The abstract result of a primitive of `operands`: `shape` and `dtype`, varying
    over every mesh axis that any operand varies over (`check_vma`, inside
    `jax.shard_map`), so that a jaxpr traced with it runs with the values its rules
    compute; a plain `ShapedArray` elsewhere."""
    avals = [
        x if isinstance(x, jax.core.AbstractValue) else jax.typeof(x) for x in operands
    ]
    varying = frozenset().union(*map(varying_axes, avals))
    if not varying:
        return jax.core.ShapedArray(tuple(shape), dtype)
    ref: Any = next(a for a in avals if varying_axes(a))
    return ref.update(
        shape=tuple(shape),
        dtype=dtype,
        weak_type=False,
        sharding=ref.sharding.update(spec=P()),
        manual_axis_type=ref.manual_axis_type.update(varying=varying),
    )


def factored_type(shape: tuple, dtype: Any, left: Any, right: Any) -> Any:
    """The type of the matrix `left @ right^T` (with leading batch dims): the
    sharding of `left`'s rows on its rows and of `right`'s rows on its columns, and
    varying over every mesh axis that either factor varies over (`check_vma`)."""
    ref = jax.typeof(left)
    sharding = getattr(ref, "sharding", None)
    mat = getattr(ref, "manual_axis_type", None)
    if sharding is None or mat is None:
        return jax.core.ShapedArray(shape, dtype)
    left_spec = _padded(ref)
    right_ref = jax.typeof(right)
    # A spec names axes of its own mesh: `right`'s (an auto axis that
    # `with_sharding_constraint` put in its type) may not be `left`'s.
    same_mesh = (
        getattr(getattr(right_ref, "sharding", None), "mesh", None) == sharding.mesh
    )
    right_spec = _padded(right_ref) if same_mesh else (None,) * right_ref.ndim
    rows, cols = left_spec[-2], right_spec[-2]
    if _axes(rows) & _axes(cols) or _axes(cols) & _axes(left_spec[:-2]):
        cols = None
    varying = mat.varying | varying_axes(right)
    return ref.update(
        shape=tuple(shape),
        dtype=dtype,
        weak_type=False,
        sharding=sharding.update(spec=P(*left_spec[:-2], rows, cols)),
        manual_axis_type=mat.update(varying=varying),
    )


def _padded(aval: Any) -> tuple:
    spec = tuple(getattr(getattr(aval, "sharding", None), "spec", None) or ())
    return spec + (None,) * (aval.ndim - len(spec))


def _axes(entry: Any) -> set:
    if entry is None:
        return set()
    if isinstance(entry, tuple) and not isinstance(entry, P):
        return set().union(*(_axes(e) for e in entry))
    return set(entry) if isinstance(entry, tuple) else {entry}


def typed_as(aval: Any, spec: Any) -> Any:
    """`aval` with its sharding spec replaced by `spec` (`None`: unchanged), varying
    mesh axes kept."""
    sharding = getattr(aval, "sharding", None)
    if spec is None or sharding is None or getattr(sharding, "mesh", None) is None:
        return aval
    if sharding.mesh.empty:  # factors typed without a mesh (a scan's zeros, say)
        mesh = jax.sharding.get_abstract_mesh()
        if mesh.empty:
            return aval
        return aval.update(sharding=jax.sharding.NamedSharding(mesh, spec))
    return aval.update(sharding=sharding.update(spec=spec))


def sliced_struct(x: Array) -> jax.ShapeDtypeStruct:
    """The shape, dtype and (under explicit axes) sharding of one slice `x[i]` of
    `x` along its leading dim: what a scan's body receives. Inside `jax.shard_map`
    it keeps the mesh axes `x` varies over, so that the body is traced with the
    types it runs with."""
    aval = jax.typeof(x)
    sharding = getattr(aval, "sharding", None)
    manual = getattr(aval, "mat", None)
    if sharding is not None and getattr(manual, "varying", None):
        # A struct's varying axes need its mesh, the body's manual one.
        return jax.ShapeDtypeStruct(
            x.shape[1:],
            x.dtype,
            sharding=jax.sharding.NamedSharding(sharding.mesh, P(*sharding.spec[1:])),
            manual_axis_type=manual,
        )
    if not explicit_axes() or sharding is None or sharding.mesh.empty:
        return jax.ShapeDtypeStruct(x.shape[1:], x.dtype)
    spec = P(*spec_entries(x)[1:])
    return jax.ShapeDtypeStruct(
        x.shape[1:], x.dtype, sharding=jax.sharding.NamedSharding(sharding.mesh, spec)
    )


def typed_like(x: Array, reference: Array) -> Array:
    """`x` resharded to `reference`'s spec where their specs differ under explicit
    axes (a no-op otherwise): for a compressed `x`, its rule retypes it without
    moving data."""
    if not explicit_axes():
        return x
    return _resharded(x, P(*spec_entries(reference)))


def typed_like_spec(x: Array, spec: Any) -> Array:
    """`x` resharded to `spec` (padded to `x`'s rank) where its own differs."""
    entries = tuple(spec) + (None,) * (jnp.ndim(x) - len(spec))
    return _resharded(x, P(*entries))


def factors_like(
    left: Float[Array, "*batch m r"], right: Float[Array, "*batch n r"], aval: Any
) -> tuple[Array, Array]:
    """The factors of a `(*batch, m, n)` matrix resharded so that their product is
    typed as `aval` (a type with a sharding, say the weight's): `left` takes
    `P(*batch, rows, None)` and `right` `P(*batch, cols, None)` for `aval`'s
    `P(*batch, rows, cols)`. A no-op without explicit axes. The factors are the
    small arrays, so this never moves a matrix-sized one."""
    if not explicit_axes():
        return left, right
    spec = getattr(getattr(aval, "sharding", None), "spec", None)
    if spec is None:
        return left, right
    *batch, rows, cols = tuple(spec) + (None,) * (len(aval.shape) - len(spec))
    return (
        _resharded(left, P(*batch, rows, None)),
        _resharded(right, P(*batch, cols, None)),
    )


def unsharded_along(x: Array, axis: int) -> Array:
    """`x` with its dim `axis` whole on every device (its other dims keep their
    sharding) under explicit mesh axes, `x` itself otherwise: JAX sorts only along a
    dim that is not sharded (from 0.12.1 it refuses to; `jnp.unique` sorts)."""
    entries = list(spec_entries(x))
    if entries[axis] is None:
        return x
    entries[axis] = None
    return jax.sharding.reshard(x, P(*entries))


def _resharded(x: Array, spec: P) -> Array:
    return x if P(*spec_entries(x)) == spec else jax.sharding.reshard(x, spec)


# The precision of the products that orthonormalise. A TPU runs a float32 product at
# the default precision as one bfloat16 pass (a GPU, as TensorFloat-32), so a Gram
# matrix so computed is off by about 3e-3 of its largest entry. On one TPU v5e chip,
# at the default precision, the range finder's projectors were orthonormal to
# 2e-3 to 4e-3 only, and exactly orthonormal float32 projectors failed the
# in-program check (`max |P^T P - I|` measured 2e-4 to 4e-4, against a tolerance of
# 4e-5 to 7e-5); at HIGHEST, 2e-5 and 2e-7 (`benchmarks/bench_precision.py`). The
# 1B step of `benchmarks/bench_scale.py` then refreshed its projectors in 8.5 s
# instead of 10.5 (the eigendecompositions converge sooner on accurate Gram
# matrices), for about 11% more compile time (see `docs/collectives.md`), most of
# which the products in blocks of rows of `_row_blocks` won back on a TPU.
EXACT = jax.lax.Precision.HIGHEST


def matmul(
    a: Float[Array, "m k"], b: Float[Array, "k n"], precision: Any = None
) -> Float[Array, "m n"]:
    """`a @ b` for matrices; under explicit axes the result keeps `a`'s row sharding
    and `b`'s column sharding (the latter dropped where it reuses an axis of the
    former), and a sharded contracting dim becomes a reduction over it.
    `precision`: as `jnp.matmul`'s (`EXACT` where the product orthonormalises)."""
    if not explicit_axes():
        if a.ndim == 2 and b.ndim == 2:
            # On a TPU, a tall float32 `a` in blocks of rows (`_row_blocks`).
            return exact_matmul(a, b, precision)
        return jnp.matmul(a, b, precision=precision)
    rows, cols = spec_entries(a)[0], spec_entries(b)[1]
    if _axes(rows) & _axes(cols):
        cols = None
    return jnp.matmul(a, b, precision=precision, out_sharding=P(rows, cols))


def gram(a: Float[Array, "m w"]) -> Float[Array, "w w"]:
    """`a^T a` at the `EXACT` precision, replicated: the reduction runs over `a`'s
    (maybe sharded) rows."""
    if not explicit_axes():
        # On a TPU, a tall float32 `a` in blocks of rows (`_row_blocks`).
        return exact_gram(a, EXACT)
    return jnp.matmul(a.T, a, precision=EXACT, out_sharding=P(None, None))


def batched_gram(a: Float[Array, "*batch m w"]) -> Float[Array, "*batch w w"]:
    """`a^T a` per matrix of a stack, at the `EXACT` precision; under explicit axes
    replicated over the matrix dims (the reduction runs over `a`'s maybe sharded
    rows)."""
    a_t = jnp.swapaxes(a, -1, -2)
    if not explicit_axes():
        return jnp.matmul(a_t, a, precision=EXACT)
    spec = P(*spec_entries(a)[:-2], None, None)
    return jnp.matmul(a_t, a, precision=EXACT, out_sharding=spec)


def like(x: Array, reference: Array) -> Array:
    """`x` resharded as `reference` is, under explicit axes (a no-op otherwise)."""
    if not explicit_axes():
        return x
    spec = P(*spec_entries(reference))
    if P(*spec_entries(x)) == spec:
        return x
    return jax.sharding.reshard(x, spec)


def orthonormal_columns(y: Float[Array, "m w"]) -> Float[Array, "m w"]:
    """Orthonormal columns spanning the numerical range of `y`, for `w` small, from
    `w x w` Gram matrices only, so that rows of `y` may be sharded.

    1. Scale `y` by its largest magnitude (so that its Gram matrix neither overflows
        nor underflows), then one shifted step: `Q = Y (Y^T Y + s I)^{-1/2}` over
        the positive eigenvalues, with the shift `s = 11 w u tr(Y^T Y)` (`u` the
        unit roundoff), which brings the condition number of `Q` down to at most
        `(11 w u)^{-1/2}` (54 for `w = 516` in float32), so that the next two
        steps reach orthogonality to rounding.
    2. Once: `Q^T Q = V L V^T` (`eigh`), `Q = Q V L^{-1/2}` over the eigenvalues
        above `10 w eps` of the largest; the others become zero columns. The
        nonzero columns are then orthonormal to about `cond(Q)^2 u`, at most
        `1 / (11 w)`.
    3. One Newton-Schulz step towards the nearest orthonormal columns, `Q = Q (3 I -
        Q^T Q) / 2`, which squares that error (`|Q^T Q - I|` goes to `3/4` of its
        square) and keeps the zero columns zero: two products where a third
        eigendecomposition was, which on a TPU is the block Jacobi method of
        `_eigh` (19 ms at 516 rows on a v5e chip, for a matrix this near the
        identity; `benchmarks/bench_eigh.py --run`).

    A rank-deficient `y` (a gradient of rank below `w`, or zero) therefore gives
    zero columns, never NaN, and the nonzero columns are orthonormal to the dtype's
    rounding (in float32 at a layer's size, about 1e-6 on a CPU and under 1e-4 on a
    TPU, whose products run at the `EXACT` precision: 3e-3 at its default).
    Directions of `y` weaker than about `3e-7 w` of its Frobenius norm in float32
    (`1.5e-4` for `w = 516`) are dropped. The columns are an orthonormal
    basis of the range, not the `Q` of a Householder QR (the range finder only
    needs the range).

    Shifted CholeskyQR (Fukaya et al., 2020) shifts by `11 (m w + w (w + 1)) u
    tr(Y^T Y)`, the worst case that keeps a Cholesky factor defined. An
    eigendecomposition needs no such bound (it drops the eigenvalues that rounding
    makes zero or negative), and in float32 at a GaLore layer's size that shift
    exceeds `tr(Y^T Y)` itself (`m w` is 2.8e6 for a `(5461, 516)` sketch): the
    next rounds then dropped every direction weaker than about 2.5% of the largest.
    A rank-512 range finder kept 51 of its 516 columns for a `(2048, 5461)` matrix
    whose singular values fall as `1/i`, and missed 1.3% of its squared norm
    against Householder QR's 0.23%; with this shift it keeps all 516 and misses
    what QR misses (`benchmarks/bench_projector_rank.py`; on one TPU v5e chip, the
    1B Llama step's attention output projectors kept 35 of 512 columns on average,
    470 with this shift).

    **Arguments:**

    - `y`: floating array `(m, w)`, `m >= w` typical; rows may be sharded.

    **Returns:**

    An array of `y`'s shape, dtype and sharding.
    """
    q, shift = orthonormal_start(y)

    def orthonormalised(i: Any, q: Array) -> Array:
        return orthonormal_round(q, gram(q), i == 0, shift)

    # A loop, not two copies: on a TPU the eigendecomposition is most of the
    # compile (a Cholesky factor and a triangular solve in the first step held
    # about a tenth of the fused kernels of the optimised HLO of
    # `bench_scale.estimate(MODELS["1B"], "projected-8bit", target="tpu-v5e")`).
    return polished(jax.lax.fori_loop(0, ORTHONORMAL_ROUNDS, orthonormalised, q))


# Rounds with an eigendecomposition: the shifted one and one more (then `polished`).
ORTHONORMAL_ROUNDS = 2


def polished(q: Float[Array, "m w"]) -> Float[Array, "m w"]:
    """One Newton-Schulz step, `q (3 I - q^T q) / 2`, for columns of `q` that are
    orthonormal to about 1e-4 or zero (`orthonormal_columns`' last step)."""
    g = gram(q)
    step = (3 * jnp.eye(g.shape[-1], dtype=g.dtype) - g) / 2
    # Laid out as `q` (a loop's carry keeps its type under explicit axes).
    return like(matmul(q, step, EXACT), q)


def orthonormal_start(y: Float[Array, "m w"]) -> tuple[Array, Array]:
    """`orthonormal_columns`' first step: `y` scaled by its largest magnitude, and
    the shift of its first round."""
    w = y.shape[-1]
    dtype = y.dtype
    largest = jnp.max(jnp.abs(y))
    q = y / jnp.where(largest > 0, largest, 1).astype(dtype)
    shift = 11 * w * (jnp.finfo(dtype).eps / 2) * jnp.sum(q * q)
    return q, shift + jnp.finfo(dtype).tiny


def orthonormal_round(
    q: Float[Array, "m w"], g: Float[Array, "w w"], first: Any, shift: Any
) -> Float[Array, "m w"]:
    """One round of `orthonormal_columns`: `q V L^{-1/2}` for `g + s I = V L V^T`
    (`g` the Gram matrix of `q`), with the shift `s` and every eigenvalue kept in
    the first round, no shift and the eigenvalues below `10 w eps` of the largest
    dropped in the others."""
    lam, v = symmetric_eigh(shifted(g, jnp.where(first, shift, 0)))
    # Laid out as `q` (a loop's carry keeps its type under explicit axes).
    return like(matmul(q, v * inverse_sqrt_kept(lam, first), EXACT), q)


def shifted(g: Float[Array, "w w"], shift: Any) -> Float[Array, "w w"]:
    """`g + shift I`."""
    return g + jnp.asarray(shift, g.dtype) * jnp.eye(g.shape[-1], dtype=g.dtype)


def inverse_sqrt_kept(lam: Float[Array, " w"], first: Any) -> Float[Array, " w"]:
    """`lam^{-1/2}` over the eigenvalues a round of `orthonormal_columns` keeps (all
    in the first round; those above `10 w eps` of the largest in the others), 0
    for the others."""
    w = lam.shape[-1]
    floor = jnp.where(first, 0, (10 * w * jnp.finfo(lam.dtype).eps) * jnp.max(lam))
    keep = lam > floor
    return jnp.where(keep, jax.lax.rsqrt(jnp.where(keep, lam, 1)), 0)


def column_signs(p: Float[Array, "*batch m r"]) -> Float[Array, "*batch 1 r"]:
    """`+1` or `-1` per column of `p`, making each column's sum non-negative. Singular
    vectors are defined up to sign, and eigh's sign depends on rounding: multiplying
    by these makes two computations of one projector agree."""
    total = jnp.sum(p, axis=-2, keepdims=True)
    return jnp.where(total < 0, -1, 1).astype(p.dtype)


def top_left_singular(b: Float[Array, "w n"], rank: int) -> Float[Array, "w rank"]:
    """The top `rank` left singular vectors of a short `(w, n)` matrix whose columns
    may be sharded: eigenvectors of the replicated `b b^T`, largest first. They are
    orthonormal whatever the conditioning (only their order and the split of nearly
    equal singular values depend on it)."""
    _, v = symmetric_eigh(gram(b.T))
    return v[:, ::-1][:, :rank]
