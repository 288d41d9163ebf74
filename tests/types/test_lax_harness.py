"""JAX's differentiable `lax` operations with every compressed type, against dense JAX.

Each case runs one operation with compressed tangents (`qt.jvp`), a compressed
cotangent seed (`qt.vjp`) or under `jax.vmap` of `qt.jvp`, and checks that the numbers
and shapes equal dense JAX on the materialised values, and that every output is either
still compressed, a vector (at most one dimension other than 1, which needs no
counting), or that a densification was counted.

Inputs of two dims are unbatched values; inputs of three dims are values with one batch
dim. The default run covers a representative subset; `HYPOTHESIS_PROFILE=thorough`
runs every operation.
"""

import dataclasses
import functools
import os
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax

import quax_tangents as qt
from quax_tangents._core._fallback import is_vector_shape
from tests.helpers import assert_close, random_array
from tests.helpers.values import TYPE_NAMES, compressed


THOROUGH = os.environ.get("HYPOTHESIS_PROFILE") == "thorough"


@dataclasses.dataclass(frozen=True)
class Op:
    name: str
    fn: Callable
    shapes: tuple[tuple[int, ...], ...]


def _op(name, fn, *shapes):
    return Op(name, fn, tuple(shapes))


_W = np.asarray(np.random.default_rng(7).uniform(0.1, 0.9, (4, 5)), np.float32)
_MASK = np.asarray(np.random.default_rng(8).uniform(size=(3, 4)) > 0.5)

_UNARY = {
    "neg": lax.neg,
    "sin": lax.sin,
    "cos": lax.cos,
    "tan": lax.tan,
    "tanh": lax.tanh,
    "exp": lax.exp,
    "exp2": lax.exp2,
    "expm1": lax.expm1,
    "log": lax.log,
    "log1p": lax.log1p,
    "sqrt": lax.sqrt,
    "rsqrt": lax.rsqrt,
    "cbrt": lax.cbrt,
    "logistic": lax.logistic,
    "abs": lax.abs,
    "sign": lax.sign,
    "floor": lax.floor,
    "ceil": lax.ceil,
    "round": lax.round,
    "erf": lax.erf,
    "erfc": lax.erfc,
    "erf_inv": lax.erf_inv,
    "asin": lax.asin,
    "acos": lax.acos,
    "atan": lax.atan,
    "sinh": lax.sinh,
    "cosh": lax.cosh,
    "asinh": lax.asinh,
    "acosh": lambda x: lax.acosh(x + 1.5),
    "atanh": lax.atanh,
    "lgamma": lax.lgamma,
    "digamma": lax.digamma,
    "square": lax.square,
    "integer_pow": lambda x: lax.integer_pow(x, 3),
    "reciprocal": lambda x: lax.integer_pow(x, -1),
    "copy": lax.copy_p.bind,
    "convert_element_type": lambda x: lax.convert_element_type(x, jnp.float32),
    "reduce_precision": lambda x: lax.reduce_precision(x, 8, 23),
    "clamp": lambda x: lax.clamp(0.3, x, 0.7),
    "stop_gradient": lax.stop_gradient,
}

_BINARY = {
    "add": lax.add,
    "sub": lax.sub,
    "mul": lax.mul,
    "div": lax.div,
    "max": lax.max,
    "min": lax.min,
    "pow": lax.pow,
    "atan2": lax.atan2,
    "rem": lax.rem,
}
_BINARY_SHAPES = [
    ((3, 4), (3, 4)),
    ((3, 4), (3, 1)),
    ((3, 4), (1, 4)),
    ((2, 3, 4), (2, 1, 4)),
]


# The default run: broadcasting sums and products, an empty and a partial reduction,
# the structural ops and contractions every type has rules for, and one nonlinearity.
_QUICK = {
    "add-3x4+3x1",
    "sub-2x3x4+2x1x4",
    "mul-3x4+1x4",
    "sin-3x4",
    "reduce_sum()-3x4x5",
    "reduce_sum(1)-2x3x4",
    "transpose(0,2,1)-2x3x4",
    "reshape(6,4)-2x3x4",
    "broadcast_in_dim(3,4)-3x1",
    "dot(x, W)-3x4",
    "dot_general(batch)-2x3x4+2x4x5",
    "concatenate(0)-3x4+2x4",
    "cumsum(0)-3x4",
    "select_n-3x4+3x4",
}


def _op_id(op: Op) -> str:
    return f"{op.name}-{'+'.join('x'.join(map(str, s)) for s in op.shapes)}"


def _ops() -> list[Op]:
    ops = []
    for name, fn in _UNARY.items():
        ops.append(_op(name, fn, (3, 4)))
        ops.append(_op(name, fn, (2, 3, 4)))
    for name, fn in _BINARY.items():
        for shapes in _BINARY_SHAPES:
            ops.append(_op(name, fn, *shapes))
    ops += [
        # Reductions, over no axes too (the identity).
        _op("reduce_sum()", lambda x: lax.reduce_sum(x, ()), (3, 4)),
        _op("reduce_sum()", lambda x: lax.reduce_sum(x, ()), (3, 4, 5)),
        _op("reduce_sum(0)", lambda x: lax.reduce_sum(x, (0,)), (3, 4)),
        _op("reduce_sum(1)", lambda x: lax.reduce_sum(x, (1,)), (3, 4)),
        _op("reduce_sum(0,1)", lambda x: lax.reduce_sum(x, (0, 1)), (3, 4)),
        _op("reduce_sum(0)", lambda x: lax.reduce_sum(x, (0,)), (2, 3, 4)),
        _op("reduce_sum(1)", lambda x: lax.reduce_sum(x, (1,)), (2, 3, 4)),
        _op("reduce_sum(2)", lambda x: lax.reduce_sum(x, (2,)), (2, 3, 4)),
        _op("reduce_max(1)", lambda x: lax.reduce_max(x, (1,)), (3, 4)),
        _op("reduce_max()", lambda x: lax.reduce_max(x, ()), (3, 4)),
        _op("reduce_min(0)", lambda x: lax.reduce_min(x, (0,)), (2, 3, 4)),
        _op("reduce_prod(1)", lambda x: lax.reduce_prod(x, (1,)), (3, 4)),
        _op("cumsum(0)", lambda x: lax.cumsum(x, 0), (3, 4)),
        _op("cumsum(1)", lambda x: lax.cumsum(x, 1), (2, 3, 4)),
        _op("cumsum(1,rev)", lambda x: lax.cumsum(x, 1, reverse=True), (3, 4)),
        _op("cumprod(1)", lambda x: lax.cumprod(x, 1), (3, 4)),
        _op("cummax(0)", lambda x: lax.cummax(x, 0), (3, 4)),
        _op("cumlogsumexp(1)", lambda x: lax.cumlogsumexp(x, 1), (3, 4)),
        # Structure.
        _op("transpose(1,0)", lambda x: lax.transpose(x, (1, 0)), (3, 4)),
        _op("transpose(0,2,1)", lambda x: lax.transpose(x, (0, 2, 1)), (2, 3, 4)),
        _op("transpose(1,0,2)", lambda x: lax.transpose(x, (1, 0, 2)), (2, 3, 4)),
        _op("transpose(2,1,0)", lambda x: lax.transpose(x, (2, 1, 0)), (2, 3, 4)),
        _op("reshape(12)", lambda x: lax.reshape(x, (12,)), (3, 4)),
        _op("reshape(4,3)", lambda x: lax.reshape(x, (4, 3)), (3, 4)),
        _op("reshape(6,4)", lambda x: lax.reshape(x, (6, 4)), (2, 3, 4)),
        _op("reshape(1,3,4)", lambda x: lax.reshape(x, (1, 3, 4)), (3, 4)),
        _op("reshape(3)", lambda x: lax.reshape(x, (3,)), (3, 1)),
        _op("broadcast_in_dim(3,4)", lambda x: lax.broadcast_in_dim(x, (3, 4), (0, 1)), (3, 1)),
        _op("broadcast_in_dim(3,4)", lambda x: lax.broadcast_in_dim(x, (3, 4), (0, 1)), (1, 4)),
        _op("broadcast_in_dim(2,3,4)", lambda x: lax.broadcast_in_dim(x, (2, 3, 4), (1, 2)), (3, 4)),
        _op("broadcast_in_dim(3,4,2)", lambda x: lax.broadcast_in_dim(x, (3, 4, 2), (0, 1)), (3, 4)),
        _op("expand_dims", lambda x: lax.expand_dims(x, (0,)), (3, 4)),
        _op("squeeze", lambda x: lax.squeeze(x, (1,)), (3, 1, 4)),
        _op("slice", lambda x: lax.slice(x, (1, 0), (3, 4)), (3, 4)),
        _op("slice", lambda x: lax.slice(x, (0, 1, 1), (2, 3, 3), (1, 1, 2)), (2, 3, 4)),
        _op("dynamic_slice", lambda x: lax.dynamic_slice(x, (1, 1), (2, 2)), (3, 4)),
        _op("rev", lambda x: lax.rev(x, (1,)), (3, 4)),
        _op("pad", lambda x: lax.pad(x, 0.0, ((1, 0, 0), (0, 2, 1))), (3, 4)),
        _op("concatenate(0)", lambda x, y: lax.concatenate([x, y], 0), (3, 4), (2, 4)),
        _op("concatenate(2)", lambda x, y: lax.concatenate([x, y], 2), (2, 3, 4), (2, 3, 2)),
        _op("select_n", lambda x, y: lax.select_n(_MASK, x, y), (3, 4), (3, 4)),
        _op("gather", lambda x: x[jnp.array([2, 0, 2])], (3, 4)),
        _op("scatter_add", lambda x, y: x.at[jnp.array([0, 2])].add(y), (3, 4), (2, 4)),
        _op("dynamic_update_slice", lambda x, y: lax.dynamic_update_slice(x, y, (1, 1)), (3, 4), (2, 2)),
        _op("sort(1)", lambda x: lax.sort(x, dimension=1), (3, 4)),
        # Contractions.
        _op("dot(x, W)", lambda x: x @ _W, (3, 4)),
        _op("dot(W.T, x.T)", lambda x: lax.dot_general(_W, x, (((0,), (1,)), ((), ()))), (3, 4)),
        _op("dot_general(x, y)", lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ()))), (3, 4), (4, 5)),
        _op("dot_general(c0)", lambda x, y: lax.dot_general(x, y, (((0,), (0,)), ((), ()))), (4, 3), (4, 5)),
        _op("dot_general(batch)", lambda x, y: lax.dot_general(x, y, (((2,), (1,)), ((0,), (0,)))), (2, 3, 4), (2, 4, 5)),
        _op("dot_general(c1,c1)", lambda x, y: lax.dot_general(x, y, (((1,), (1,)), ((), ()))), (3, 4), (5, 4)),
        _op("dot_general(both)", lambda x, y: lax.dot_general(x, y, (((0, 1), (0, 1)), ((), ()))), (3, 4), (3, 4)),
    ]  # fmt: skip
    return ops if THOROUGH else [op for op in ops if _op_id(op) in _QUICK]


OPS = _ops()


# ---------------------------------------------------------------------------------
# Values


@functools.cache
def _primal(shape, seed):
    # Inside every domain used above: positive and below 1 (log, sqrt, asin, atanh).
    return np.asarray(random_array(seed, shape, low=0.1, high=0.9))


# Each case compiles once; XLA's backend optimisations cost more than they save here.
_FAST_COMPILE = {
    "xla_backend_optimization_level": 0,
    "xla_llvm_disable_expensive_passes": True,
}


def _total_counts() -> int:
    return sum(qt.fallback_counts().values())


def _inputs(mode: str, op: Op, type_name: str):
    """`(primals, tangents or seed)` of one case, or a string saying why it has none."""
    primals = tuple(_primal(s, i) for i, s in enumerate(op.shapes))
    if mode == "vjp":
        out_shape = jax.eval_shape(op.fn, *primals).shape
        seed = compressed(type_name, out_shape, 5)
        return (primals, seed) if seed is not None else f"no {out_shape} {type_name}"
    batch = (2,) if mode == "vmap" else ()
    if mode == "vmap":
        primals = tuple(jnp.asarray(np.stack([p, p * 0.5 + 0.1])) for p in primals)
    tangents = tuple(
        compressed(type_name, (*batch, *s), 10 * i + 1) for i, s in enumerate(op.shapes)
    )
    return (primals, tangents) if None not in tangents else f"no {type_name} here"


def _outputs(mode: str, op: Op, primals, given):
    """The quax-tangents result and the dense JAX result of one case."""
    if mode == "jvp":
        got = qt.jvp(op.fn, primals, given)[1]
        expected = jax.jvp(op.fn, primals, qt.materialise(given))[1]
    elif mode == "vjp":
        got = qt.vjp(op.fn, *primals)[1](given)
        expected = jax.vjp(op.fn, *primals)[1](given.materialise())
    else:
        got = jax.vmap(lambda p, t: qt.jvp(op.fn, p, t)[1])(primals, given)
        expected = jax.vmap(lambda p, t: jax.jvp(op.fn, p, t)[1])(
            primals, qt.materialise(given)
        )
    return got, expected


def _check(type_name: str, mode: str, op: Op):
    given = _inputs(mode, op, type_name)
    if isinstance(given, str):
        pytest.skip(given)
    is_value = lambda x: isinstance(x, qt.CompressedArray)  # noqa: E731
    traced = {}

    def run(given):
        # Counting and dispatch happen while tracing: record what we need then, and
        # compile the case (quax-tangents and dense JAX) as one program.
        before = _total_counts()
        got, expected = _outputs(mode, op, *given)
        traced["densified"] = _total_counts() > before
        leaves, traced["tree"] = jax.tree.flatten(got, is_leaf=is_value)
        traced["compressed"] = [is_value(x) for x in leaves]
        want, traced["want_tree"] = jax.tree.flatten(expected)
        return [x.materialise() if is_value(x) else x for x in leaves], want

    with qt.fallback("silent"):
        got, want = jax.jit(run, compiler_options=_FAST_COMPILE)(given)
    assert traced["tree"] == traced["want_tree"], traced
    for out, expected, compressed_out in zip(
        got, want, traced["compressed"], strict=True
    ):
        assert out.shape == expected.shape, (out.shape, expected.shape)
        assert out.dtype == expected.dtype, (out.dtype, expected.dtype)
        assert_close(out, expected, factor=8.0)
        # A vector needs no counting (under vmap the rules see one example: a vector
        # each); nor does an all-zero output, which JAX makes from a symbolic zero
        # (`floor`, `stop_gradient`), not from the tangent.
        example_shape = expected.shape[1:] if mode == "vmap" else expected.shape
        assert (
            compressed_out
            or traced["densified"]
            or is_vector_shape(example_shape)
            or not np.any(np.asarray(expected))
        ), f"a dense {expected.shape} output and no densification counted"


def _cases():
    for op in OPS:
        for type_name in TYPE_NAMES:
            for mode in ("jvp", "vjp", "vmap"):
                name = f"{mode}-{_op_id(op)}-{type_name}"
                yield pytest.param(mode, op, type_name, id=name)


@pytest.mark.parametrize("mode, op, type_name", list(_cases()))
def test_lax_op(mode, op, type_name):
    _check(type_name, mode, op)
