"""The protocol every compressed representation implements, and the shared fallback."""

import abc
import math
import operator
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import equinox as eqx
import jax
import jax.core
import jax.extend.core as jexc
import jax.numpy as jnp
import jax.tree_util as jtu
import quax
from jaxtyping import Array, ArrayLike, PyTree
from quax.examples.zero import Zero

from ._devices import dense_all_reduce, varying_alike
from ._fallback import record_densification
from ._guard import GUARD_MESSAGE, guard, is_guard
from ._lax import add_any_p
from ._registry import rule


class _ReprMeta(type(quax.ArrayValue)):
    # JAX's pytree-structure errors name a node by its class's repr ("the full pytree
    # has a subtree of type <class ...>"): where generic code meets a compressed value
    # that way, the error then says what to use instead.
    def __repr__(cls) -> str:
        return f"<class '{cls.__module__}.{cls.__qualname__}', {GUARD_MESSAGE}>"


# Type checkers cannot follow a metaclass derived from `type(...)`, and then read
# every constructor as taking no positional arguments: show them plain `type`, so
# that equinox's dataclass fields give the signatures.
if TYPE_CHECKING:
    _CompressedMeta = type
else:
    _CompressedMeta = _ReprMeta


class CompressedArray(quax.ArrayValue, metaclass=_CompressedMeta):
    """Abstract base of every compressed representation, and the protocol each one
    implements.

    A subclass stores a smaller (possibly lossy) structure and presents itself to JAX
    as a dense array of `aval()`'s shape and dtype. Only `aval` and `materialise` are
    required. Every other method of the protocol has a default that is correct for
    any subclass (it densifies, counted through the fallback policy); a type
    overrides one where it has a cheaper exact form:

    - `aval()`, `materialise()`: the dense array's shape and dtype, and its values.
    - `nbytes`, `dense_nbytes`, `compression_ratio`, `batch_ndim`: storage.
    - `join_branches(values)`: one structure for values of this type that differ in
        field shapes (the branches of one `lax.cond` output).
    - `fit_carry(like)`: a loop body's output carry brought back to the structure of
        the carry that entered the body (`lax.scan`, `lax.while_loop`).
    - `all_reduce(axis_name, mean=)`: the exact sum (or mean) over devices inside
        `shard_map`, moving only compressed fields where the type can.
    - `chunk_compressor()`: how this type compresses one flat (1-D) chunk of an
        array with its own settings, for the two-phase all-reduce (`TwoPhase`);
        `None` where it has no such form.
    - `inner(other)`: `sum(conj(self) * other)`.

    Compressed values also support Python's operators (`t + t`, `2 * t`, `x @ t`,
    `t.T`, `t[0]`), which run through the type's rules as inside
    `quax.quaxify`.

    Every value also carries a guard leaf (`_guard`, zero bytes, of the value's
    batch shape) that JAX refuses any arithmetic on, so that leafwise code
    (`jax.tree.map`, optax) that reaches the fields fails with an error naming the
    fix instead of computing a wrong answer; see `_guard.py`. Constructors set it;
    rules that build values without `__init__` go through `unchecked`, which does.
    """

    _guard: Any = eqx.field(default=None, init=False)

    def __check_init__(self) -> None:
        # Runs after every subclass's `__init__` (equinox calls each class's
        # `__check_init__`); the only place all constructors pass through.
        install_guard(self)

    def _fill_unset_fields(self) -> None:
        # Called by `unchecked`, which rules build their outputs with.
        install_guard(self)

    @abc.abstractmethod
    def aval(self) -> jax.core.ShapedArray: ...

    @abc.abstractmethod
    def materialise(self) -> Array: ...

    # -- storage ---------------------------------------------------------------------

    @property
    def batch_ndim(self) -> int:
        """How many leading dims every field shares as batch dims, so that slicing
        every field along them (as `lax.scan` and `vmap` do) slices the value."""
        return 0

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the sum over the array fields. Works on shape-only
        values too (fields that are `jax.ShapeDtypeStruct`s, from `jax.eval_shape`)."""
        return sum(
            math.prod(leaf.shape) * jnp.dtype(leaf.dtype).itemsize
            for leaf in jtu.tree_leaves(self)
            if not is_guard(leaf)
        )

    @property
    def dense_nbytes(self) -> int:
        """Bytes of the dense array this value represents."""
        aval = self.aval()
        return math.prod(aval.shape) * jnp.dtype(aval.dtype).itemsize

    @property
    def compression_ratio(self) -> float:
        """`dense_nbytes / nbytes`: how many times smaller than dense."""
        return self.dense_nbytes / max(self.nbytes, 1)

    # -- control flow ----------------------------------------------------------------

    @classmethod
    def join_branches(
        cls, values: Sequence["CompressedArray"]
    ) -> "Callable[[CompressedArray], CompressedArray] | None":
        """How values of this type whose fields differ in shape (the branches of one
        `lax.cond` output) are brought to one structure.

        **Arguments:**

        - `values`: one value per branch, each an instance of `cls`. They may be
            shape-only (fields are `jax.ShapeDtypeStruct`s): read shapes, not data.

        **Returns:**

        A function applied to each branch's value that returns the common structure
        without changing the array it represents, or `None` when there is none: the
        branches are then densified, counted.
        """
        del values
        return None

    def fit_carry(self, like: "CompressedArray") -> "CompressedArray | None":
        """This value, a loop body's output carry, brought back to the structure of
        `like`, the carry that entered the body.

        **Arguments:**

        - `like`: the input carry, of the same type; possibly shape-only.

        **Returns:**

        A value with `like`'s field shapes, or `None` when no compressed form fits:
        the loop then runs with a dense carry, counted. A type may raise a
        `TypeError` instead, saying how to make the carry fit.
        """
        del like
        return None

    # -- collectives -----------------------------------------------------------------

    def all_reduce(self, axis_name: Any, *, mean: bool = False) -> Any:
        """The exact sum over devices along `axis_name`, inside `shard_map`.

        The default materialises (counted) and runs a dense `psum`; types override
        it to move only their compressed fields. Called by
        [`quax_tangents.all_reduce`][] with `GatherSum()`.

        **Arguments:**

        - `axis_name`: a mesh axis name, or a tuple of them.
        - `mean`: divide by the number of devices.

        **Returns:**

        The sum, identical (invariant) on every device: a compressed value or a
        dense array.
        """
        record_densification(
            "all_reduce", (type(self).__name__,), "no compressed all-reduce"
        )
        return dense_all_reduce(self.materialise(), axis_name, mean=mean)

    def chunk_compressor(self) -> "ChunkCompressor | None":
        """How this type compresses a 1-D chunk of an array with its own settings, for
        [`quax_tangents.TwoPhase`][], which splits a value into one flat chunk per
        device.

        The default is `None`: the type has no per-chunk form, and `TwoPhase` sums
        its values with `all_reduce` instead (for the library's `LowRank`, whose
        factors do not split into flat chunks).

        **Returns:**

        A [`quax_tangents.ChunkCompressor`][], or `None`.
        """
        return None

    # -- linear algebra --------------------------------------------------------------

    def inner(self, other: "ArrayLike | CompressedArray") -> Array:
        """The inner product `sum(conj(self) * other)`, a scalar.

        The default runs the product and the sum through the rules of the operands'
        types (counting any densification); types override it with a cheaper exact
        form.

        **Arguments:**

        - `other`: a dense array or a compressed value of the same shape.

        **Returns:**

        A 0-d array of the promoted dtype.
        """
        _check_same_shape("inner", self, other)
        return quax.quaxify(_conj_dot)(self, other)

    # -- Python operators ------------------------------------------------------------

    # numpy defers to our reflected operators instead of making an object array.
    __array_ufunc__ = None

    def __array__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"A {type(self).__name__} is not converted to a NumPy array implicitly; "
            "call `quax_tangents.materialise(value)` for its dense array."
        )

    def __neg__(self) -> Any:
        return _apply(operator.neg, self)

    def __pos__(self) -> Any:
        return self

    def __add__(self, other: Any) -> Any:
        _refuse_another_view(self, other)
        return _apply(operator.add, self, other)

    def __radd__(self, other: Any) -> Any:
        _refuse_another_view(self, other)
        return _apply(operator.add, other, self)

    def __sub__(self, other: Any) -> Any:
        _refuse_another_view(self, other)
        return _apply(operator.sub, self, other)

    def __rsub__(self, other: Any) -> Any:
        _refuse_another_view(self, other)
        return _apply(operator.sub, other, self)

    def __mul__(self, other: Any) -> Any:
        return _apply(operator.mul, self, other)

    def __rmul__(self, other: Any) -> Any:
        return _apply(operator.mul, other, self)

    def __truediv__(self, other: Any) -> Any:
        return _apply(operator.truediv, self, other)

    def __rtruediv__(self, other: Any) -> Any:
        return _apply(operator.truediv, other, self)

    def __pow__(self, other: Any) -> Any:
        return _apply(operator.pow, self, other)

    def __matmul__(self, other: Any) -> Any:
        return _apply(operator.matmul, self, other)

    def __rmatmul__(self, other: Any) -> Any:
        return _apply(operator.matmul, other, self)

    def __getitem__(self, index: Any) -> Any:
        return _apply(lambda x: x[index], self)

    @property
    def T(self) -> Any:
        return _apply(lambda x: x.T, self)

    @property
    def mT(self) -> Any:
        return _apply(lambda x: x.mT, self)

    def sum(self, axis: Any = None) -> Any:
        return _apply(lambda x: jnp.sum(x, axis=axis), self)

    def astype(self, dtype: Any) -> Any:
        return _apply(lambda x: x.astype(dtype), self)

    def reshape(self, *shape: Any) -> Any:
        return _apply(lambda x: x.reshape(*shape), self)

    @staticmethod
    def default(
        primitive: jexc.Primitive, values: Sequence[Any], params: dict[str, Any]
    ) -> Any:
        fix = (
            _SUM_OVER_DEVICES if primitive.name in ("psum", "psum_invariant") else None
        )
        return densify(
            primitive, values, params, reason="no rule for these operands", fix=fix
        )


# What a user who sums a compressed value over devices with `lax.psum` can do instead.
_SUM_OVER_DEVICES = (
    "`quax_tangents.all_reduce(x, axis_name)` sums it over the devices by sending "
    "its compressed fields."
)


def install_guard(value: CompressedArray) -> None:
    """Sets the guard leaf of a value built without one (by its constructor, or by
    `unchecked` in a rule), with the value's batch shape."""
    batch_ndim = value.batch_ndim
    batch_shape: tuple[int, ...] = ()
    if batch_ndim:
        # Every array field leads with the batch dims. Read them from a field, not
        # from `value.shape`, which builds the aval (slow on the eager hot path).
        field = next(
            x
            for name, x in vars(value).items()
            if name != "_guard" and isinstance(x, jax.Array) and x.ndim >= batch_ndim
        )
        batch_shape = tuple(field.shape[:batch_ndim])
    object.__setattr__(value, "_guard", guard(batch_shape))


def map_fields(fn: Callable[[Array], Array], value: CompressedArray) -> Any:
    """`value` with `fn` applied to each array field (as `jax.tree.map` would), and a
    fresh guard leaf for the result's batch shape. For code that moves the fields as
    they are (collectives over stacked values), not for arithmetic."""
    out = jtu.tree_map(lambda f: f if is_guard(f) else fn(f), value)
    install_guard(out)
    return out


class ChunkCompressor(eqx.Module):
    """A compressor of 1-D chunks, as a type's `chunk_compressor()` gives it.

    - `compress`: a function from a 1-D floating array to a compressed value of that
        shape (it is `vmap`ped over the chunks).
    - `multiple`: chunks are made a multiple of this many elements, so that they
        align with the type's blocks (a chunk then compresses exactly as the same
        elements of the whole array do).
    """

    compress: Callable[[Array], "CompressedArray"] = eqx.field(static=True)
    multiple: int = eqx.field(default=1, static=True)


def _conj_dot(x: Any, y: Any) -> Any:
    return jnp.sum(jnp.conj(x) * y)


def _refuse_another_view(x: CompressedArray, other: Any) -> None:
    """A sum with an array of the same size that does not broadcast: most likely an
    optimiser's update in the matrix view that `projected(dims=...)` gives, added
    to its stored weight by `optax.apply_updates` (which cannot reshape it)."""
    shape = jnp.shape(other)
    if shape == x.shape or math.prod(shape) != math.prod(x.shape) or not shape:
        return
    try:
        jnp.broadcast_shapes(shape, x.shape)
    except ValueError:
        raise TypeError(
            f"A {type(x).__name__} of shape {list(x.shape)} cannot be added to an "
            f"array of shape {list(shape)}. If it is an optimiser's update in the "
            "matrix view that `dims=` gives of such a weight, apply the updates with "
            "`quax_tangents.optax.apply_updates(params, updates)` (or `opt.apply` of "
            "`quax_tangents.optax.galore`), which reshapes the view: "
            "`optax.apply_updates`, `param + update` and `nnx.Optimizer.update` "
            "cannot."
        ) from None


def _apply(fn: Callable[..., Any], *operands: Any) -> Any:
    """`fn(*operands)` with compressed operands dispatched through their rules."""
    return quax.quaxify(fn)(*operands)


def _check_same_shape(name: str, x: CompressedArray, other: Any) -> None:
    if jnp.shape(other) != x.shape:
        raise ValueError(
            f"`{name}` needs operands of one shape, got {type(x).__name__} "
            f"{list(x.shape)} and {list(jnp.shape(other))}."
        )


def densify(
    primitive: jexc.Primitive,
    values: Sequence[Any],
    params: dict[str, Any],
    *,
    reason: str,
    fix: str | None = None,
) -> Any:
    """Materialises every quax value, records it with the fallback policy (`fix`: as
    for `record_densification`), and runs the primitive densely. Rules call this
    when they cannot stay compressed."""
    names = tuple(
        sorted({type(v).__name__ for v in values if isinstance(v, CompressedArray)})
    )
    record_densification(primitive.name, names, reason, fix)
    arrays = [v.materialise() if isinstance(v, quax.Value) else v for v in values]
    return primitive.bind(*varying_alike(*arrays), **params)


def materialise_values(tree: PyTree) -> PyTree:
    """Dense arrays for every concrete quax value in a pytree (see the public
    `quax_tangents.materialise`, which also reaches values inside a trace)."""
    return jtu.tree_map(
        lambda x: x.materialise() if isinstance(x, quax.Value) else x,
        tree,
        is_leaf=lambda x: isinstance(x, quax.Value),
    )


def call_with_rules(fn: Any, *args: Any) -> Any:
    """Runs `fn` so that primitives on quax values inside a rule dispatch again."""
    return quax.quaxify(fn)(*args)


def _check_zero_matches(x: CompressedArray, zero: Zero) -> None:
    if x.shape != zero.shape or x.dtype != zero.dtype:
        raise TypeError(
            f"Cannot add a {type(x).__name__} of {x.dtype}{list(x.shape)} and a Zero "
            f"of {zero.dtype}{list(zero.shape)}."
        )


# A symbolic zero adds nothing. JAX's own symbolic zeros never reach a primitive; quax's
# `Zero` does, and `add_any` is how JAX accumulates tangents and cotangents.
@rule(add_any_p, jax.lax.add_p, commutative=True)
def _add_zero(x: CompressedArray, y: Zero) -> CompressedArray:
    _check_zero_matches(x, y)
    return x


@rule(jax.lax.sub_p)
def _sub_zero(x: CompressedArray, y: Zero) -> CompressedArray:
    _check_zero_matches(x, y)
    return x


@rule(jax.lax.sub_p)
def _zero_sub(x: Zero, y: CompressedArray) -> CompressedArray:
    _check_zero_matches(y, x)
    return call_with_rules(jax.lax.neg, y)
