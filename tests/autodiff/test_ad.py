"""The autodiff entry points: jvp, partial_jvp, linearize, vjp, grad, and the
construction of compressed cotangents."""

import functools as ft
import re

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
import quax

import quax_tangents as qt
from tests.helpers import assert_close, random_array


# ---------------------------------------------------------------------------------------
# The second seed thread: JVPs over quax values with respect to some arguments only


class ArrayWrapper(quax.ArrayValue):
    array: jax.Array

    def aval(self):
        return jax.core.ShapedArray(self.array.shape, self.array.dtype)

    def materialise(self):
        raise NotImplementedError("ArrayWrapper never materialises")


@quax.register(jax.lax.dot_general_p)
def _(a: ArrayWrapper, b: ArrayWrapper, **params):
    return ArrayWrapper(jax.lax.dot_general_p.bind(a.array, b.array, **params))


@quax.register(jax.lax.dot_general_p)
def _(a: jax.Array, b: ArrayWrapper, **params):
    return ArrayWrapper(jax.lax.dot_general_p.bind(a, b.array, **params))


@quax.register(jax.lax.dot_general_p)
def _(a: ArrayWrapper, b: jax.Array, **params):
    return ArrayWrapper(jax.lax.dot_general_p.bind(a.array, b, **params))


WRAPPED = ArrayWrapper(1 + jnp.arange(3, dtype=jnp.float32))


def _single_wrapped(out):
    assert type(out) is ArrayWrapper, type(out)
    assert type(out.array) is not ArrayWrapper
    return float(out.array)


@pytest.mark.parametrize(
    "fn",
    [
        ft.partial(jnp.dot, WRAPPED),
        jtu.Partial(jnp.dot, WRAPPED),
        eqx.Partial(jnp.dot, WRAPPED),
    ],
    ids=["functools.partial", "jax.tree_util.Partial", "equinox.Partial"],
)
def test_partial_jvp_of_a_partially_applied_quax_value(fn):
    primal, tangent = qt.partial_jvp(fn, (WRAPPED,), (WRAPPED,))
    assert _single_wrapped(primal) == 14.0
    assert _single_wrapped(tangent) == 14.0


def test_partial_jvp_with_argnums_and_under_jit():
    primal, tangent = qt.partial_jvp(jnp.dot, (WRAPPED, WRAPPED), (WRAPPED,), argnums=1)
    assert (_single_wrapped(primal), _single_wrapped(tangent)) == (14.0, 14.0)
    jitted = jax.jit(lambda x: qt.partial_jvp(ft.partial(jnp.dot, x), (x,), (x,)))
    primal, tangent = jitted(WRAPPED)
    assert (_single_wrapped(primal), _single_wrapped(tangent)) == (14.0, 14.0)


class Dot(eqx.Module):
    left: ArrayWrapper

    def __call__(self, y):
        return jnp.dot(self.left, y)

    def apply(self, y):
        return jnp.dot(self.left, y)


def test_partial_jvp_of_modules_and_bound_methods():
    module = Dot(WRAPPED)
    for fn in (module, module.apply):
        primal, tangent = qt.partial_jvp(fn, (WRAPPED,), (WRAPPED,))
        assert (_single_wrapped(primal), _single_wrapped(tangent)) == (14.0, 14.0)


def test_nested_quaxify_double_wraps_but_partial_jvp_does_not():
    """The thread's failing attempt, kept as a test of the behaviour we avoid."""
    nested = quax.quaxify(
        lambda p, t: jax.jvp(ft.partial(quax.quaxify(jnp.dot), WRAPPED), p, t)
    )((WRAPPED,), (WRAPPED,))
    assert type(nested[0].array) is ArrayWrapper
    out = qt.partial_jvp(ft.partial(jnp.dot, WRAPPED), (WRAPPED,), (WRAPPED,))
    assert type(out[0].array) is not ArrayWrapper


def test_closures_over_quax_values_are_refused_with_a_fix():
    captured = WRAPPED

    with pytest.raises(TypeError, match="captures the quax value `captured`.*partial"):
        qt.partial_jvp(lambda y: jnp.dot(captured, y), (WRAPPED,), (WRAPPED,))
    with pytest.raises(TypeError, match="captures the quax value `WRAPPED`"):
        qt.jvp(lambda y: jnp.dot(WRAPPED, y), (WRAPPED,), (WRAPPED,))


def test_partial_jvp_argnums_errors():
    with pytest.raises(ValueError, match="`argnums` entry 2 is out of range"):
        qt.partial_jvp(jnp.dot, (1.0, 2.0), (1.0,), argnums=2)
    with pytest.raises(ValueError, match="`tangents` has 2 entries but `argnums`"):
        qt.partial_jvp(jnp.dot, (1.0, 2.0), (1.0, 1.0), argnums=0)
    with pytest.raises(ValueError, match="repeated"):
        qt.partial_jvp(jnp.dot, (1.0, 2.0), (1.0, 1.0), argnums=(0, 0))


# ---------------------------------------------------------------------------------------
# jvp with compressed tangents


X = random_array(0, (16, 12))
W = random_array(1, (12, 10))
B = random_array(2, (10,))
T = qt.low_rank(random_array(3, (12, 10)), 2)


def _affine(w, b):
    return X @ w + b


def test_untouched_inputs_get_symbolic_zeros_and_stay_compressed():
    with qt.fallback("error"):
        primal, tangent = qt.jvp(_affine, (W, B), (T, None))
    assert isinstance(tangent, qt.LowRank)
    assert_close(tangent.materialise(), X @ T.materialise(), scale=12.0)
    assert_close(primal, _affine(W, B))


def test_dense_zero_tangents_kill_compression():
    """The fact this API exists for: a dense zero is not known to be zero."""
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, tangent = qt.jvp(_affine, (W, B), (T, jnp.zeros_like(B)))
    assert not isinstance(tangent, qt.LowRank)
    assert qt.fallback_counts()


def test_integer_primals_are_constants():
    def f(w, n):
        return X @ w * n

    with qt.fallback("error"):
        _, tangent = qt.jvp(f, (W, 3), (T, None))
    assert isinstance(tangent, qt.LowRank)
    assert_close(tangent.materialise(), 3 * X @ T.materialise(), scale=36.0)
    with pytest.raises(TypeError, match="integer dtype.*pass `None`"):
        qt.jvp(f, (W, 3), (T, 1))


def test_tangent_mismatches_are_errors():
    with pytest.raises(ValueError, match=r"Tangent leaf 0 is float32\[12, 9\]"):
        qt.jvp(_affine, (W, B), (random_array(0, (12, 9)), None))
    with pytest.raises(ValueError, match="one tangent \\(or None\\) per primal"):
        qt.jvp(_affine, (W, B), (T,))


def test_has_aux_and_pytree_primals():
    def f(params):
        # JAX still pushes tangents through the aux computation while tracing (and
        # drops them later), so aux that is not linear in `w` would densify.
        w = jax.lax.stop_gradient(params["w"])
        return X @ params["w"] + params["b"], {"norm": jnp.sum(w**2)}

    params = {"w": W, "b": B}
    with qt.fallback("error"):
        _, tangent, aux = qt.jvp(f, (params,), ({"w": T, "b": None},), has_aux=True)
    assert isinstance(tangent, qt.LowRank)
    assert_close(aux["norm"], jnp.sum(W**2), scale=float(jnp.sum(W**2)))


def test_jvp_under_jit_and_vmap():
    jitted = jax.jit(lambda w, t: qt.jvp(lambda w: X @ w, (w,), (t,)))
    with qt.fallback("error"):
        _, tangent = jitted(W, T)
    assert isinstance(tangent, qt.LowRank)
    stacked = qt.LowRank(jnp.stack([T.left] * 3), jnp.stack([T.right] * 3))
    with qt.fallback("error"):
        _, tangents = jax.vmap(lambda t: qt.jvp(lambda w: X @ w, (W,), (t,)))(stacked)
    assert isinstance(tangents, qt.LowRank) and tangents.shape == (3, 16, 10)


def test_custom_jvp_rules_may_return_compressed_tangents():
    @jax.custom_jvp
    def scaled(w):
        return 2.0 * w

    @scaled.defjvp
    def scaled_jvp(primals, tangents):
        (w,), (t,) = primals, tangents
        return scaled(w), 2.0 * t

    with qt.fallback("error"):
        _, tangent = qt.jvp(lambda w: X @ scaled(w), (W,), (T,))
    assert isinstance(tangent, qt.LowRank)
    assert_close(tangent.materialise(), 2 * X @ T.materialise(), scale=24.0)


def test_linearize_accepts_compressed_tangents():
    out, f_jvp = qt.linearize(lambda w: jnp.sum(X @ w, axis=0) + X[0] @ w, W)
    assert_close(out, jnp.sum(X @ W, axis=0) + X[0] @ W, scale=30.0)
    with qt.fallback("error"):
        tangent = f_jvp(T)
    expected = jnp.sum(X @ T.materialise(), axis=0) + X[0] @ T.materialise()
    assert_close(tangent, expected, scale=30.0)


# ---------------------------------------------------------------------------------------
# Reverse mode


def test_vjp_pullback_accepts_a_compressed_cotangent():
    _, pullback = qt.vjp(lambda x: x @ W, X)
    seed = qt.low_rank(random_array(4, (16, 10)), 1)
    with qt.fallback("error"):
        (ct,) = pullback(seed)
    assert isinstance(ct, qt.LowRank)
    assert_close(ct.materialise(), seed.materialise() @ W.T, scale=10.0)


COMPRESSOR = ft.partial(qt.low_rank, rank=2)


def _loss(w):
    return jnp.sum(jnp.tanh(X @ qt.compress_cotangent(w, COMPRESSOR)))


def test_compress_cotangent_under_grad_and_value_and_grad():
    with qt.fallback("error"):
        grad = qt.grad(_loss)(W)
        value, grad2 = qt.value_and_grad(_loss)(W)
    assert isinstance(grad, qt.LowRank) and grad.rank == 2
    dense = jax.grad(lambda w: jnp.sum(jnp.tanh(X @ w)))(W)
    assert_close(grad.materialise(), COMPRESSOR(dense).materialise())
    assert_close(value, _loss(W), scale=float(jnp.abs(_loss(W))) + 1)
    assert_close(grad2.materialise(), grad.materialise())


def test_compress_cotangent_without_our_entry_points_is_the_same_dense_value():
    with qt.fallback("error"):
        ours = qt.grad(_loss)(W)
    plain = jax.grad(_loss)(W)
    assert isinstance(plain, jax.Array)
    assert_close(plain, ours.materialise())


@pytest.mark.parametrize(
    "wrap",
    [jax.jit, jax.checkpoint, lambda f: lambda w: jax.lax.cond(True, f, f, w)],
    ids=["jit", "checkpoint", "cond"],
)
def test_compress_cotangent_inside_transforms(wrap):
    with qt.fallback("error"):
        grad = qt.grad(wrap(_loss))(W)
        outer_jit = jax.jit(qt.grad(wrap(_loss)))(W)
    assert isinstance(grad, qt.LowRank) and isinstance(outer_jit, qt.LowRank)
    assert_close(grad.materialise(), jax.grad(_loss)(W))
    assert_close(outer_jit.materialise(), jax.grad(_loss)(W))


def test_compress_cotangent_in_a_scan_body():
    ws = jnp.stack([W, 2 * W, -W])

    def loss(ws):
        def body(total, w):
            return total + _loss(w), None

        return jax.lax.scan(body, 0.0, ws)[0]

    with qt.fallback("error"):
        grads = qt.grad(loss)(ws)
    assert isinstance(grads, qt.LowRank) and grads.shape == (3, 12, 10)
    assert_close(grads.materialise(), jax.grad(loss)(ws))


def test_compress_cotangent_checks_the_compressor():
    class Unhashable:
        __hash__ = None

        def __call__(self, x):
            return qt.low_rank(x, 1)

    with pytest.raises(TypeError, match="`compressor` must be hashable"):
        qt.compress_cotangent(W, Unhashable())


@pytest.mark.parametrize(
    "compressor, error, message",
    [
        (
            lambda x: qt.low_rank(x[:2], 1),
            ValueError,
            r"expected float32\[16, 12\].*"
            r"got a LowRank of float32\[2, 12\]",
        ),
        (
            lambda x: qt.low_rank(x.astype(jnp.float16), 1),
            ValueError,
            r"expected float32\[16, 12\].*got a LowRank of float16\[16, 12\]",
        ),
        (lambda x: 2 * x, TypeError, "must return a compressed value"),
        (3, TypeError, "`compressor` must be a function"),
    ],
    ids=["shape", "dtype", "dense", "not-callable"],
)
def test_compress_cotangent_checks_what_the_compressor_returns(
    compressor, error, message
):
    with pytest.raises(error, match=message):
        qt.compress_cotangent(X, compressor)
    # Under a transformation the check sees the per-example value.
    if callable(compressor):
        with pytest.raises(error, match="`compressor`"):
            jax.vmap(lambda x: qt.compress_cotangent(x, compressor))(X[None])


def test_compress_cotangent_notes_a_compressor_that_fails():
    with pytest.raises(ValueError, match="`rank`") as info:
        qt.compress_cotangent(jnp.ones((2, 3)), ft.partial(qt.low_rank, rank=5))
    assert any("raised by `compressor`" in note for note in info.value.__notes__)


def test_grad_of_x_at_w_is_the_exact_low_rank_outer_product():
    x = random_array(5, (4, 40))
    w = random_array(6, (40, 30))

    def loss(w):
        return jnp.sum(jnp.tanh(qt.factored_matmul(x, w)))

    with qt.fallback("error"):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, qt.LowRank) and grad.rank == 4
    assert_close(grad.materialise(), jax.grad(loss)(w), scale=4.0)
    # The m x n gradient is never formed: no instruction produces a 40x30 array,
    # while the dense gradient (the control) does.
    assert _produced(jax.jit(qt.grad(loss)), w, "f32[40,30]") == []
    assert _produced(jax.jit(jax.grad(loss)), w, "f32[40,30]") != []


def _produced(jitted, arg, shape):
    """Compiled HLO instructions, other than parameters, whose result is `shape`."""
    pattern = re.compile(r"\s*(ROOT )?%\S+ = " + re.escape(shape))
    lines = jitted.lower(arg).compile().as_text().splitlines()
    return [line for line in lines if pattern.match(line) and "parameter(" not in line]


def test_factored_matmul_checks_shapes():
    with pytest.raises(ValueError, match="`x` of shape \\(..., m\\) and `w`"):
        qt.grad(lambda w: jnp.sum(qt.factored_matmul(jnp.ones((2, 3)), w)))(
            jnp.ones((4, 5))
        )


def test_grad_argnums_has_aux_and_scalar_check():
    def loss(w, b):
        value = jnp.sum((X @ w + b) ** 2)
        return value, value

    with qt.fallback("error"):
        (gw, gb), aux = qt.grad(loss, argnums=(0, 1), has_aux=True)(W, B)
    ref = jax.grad(loss, argnums=(0, 1), has_aux=True)(W, B)
    assert_close(gw, ref[0][0], scale=float(jnp.abs(ref[0][0]).max()))
    assert_close(gb, ref[0][1], scale=float(jnp.abs(ref[0][1]).max()))
    with pytest.raises(TypeError, match="real scalar output"):
        qt.grad(lambda w: X @ w)(W)
    # A `(loss, aux)` pair without `has_aux`, traced or not, names the flag.
    with pytest.raises(TypeError, match="pass `has_aux=True`"):
        qt.grad(loss, argnums=(0, 1))(W, B)
    with pytest.raises(TypeError, match="pass `has_aux=True`"):
        jax.jit(qt.value_and_grad(loss))(W, B)


def test_forward_mode_of_a_linear_network_never_falls_back():
    widths = [12, 20, 20, 8]
    ws = [random_array(i, (a, b)) for i, (a, b) in enumerate(zip(widths, widths[1:]))]
    ts = [qt.low_rank(random_array(10 + i, w.shape), 1) for i, w in enumerate(ws)]

    def net(ws):
        h = X
        for w in ws:
            h = h @ w
        return h

    qt.reset_fallback_counts()
    with qt.fallback("error"):
        _, tangent = qt.jvp(net, (ws,), (ts,))
    assert isinstance(tangent, qt.LowRank)
    expected = jax.jvp(net, (ws,), ([t.materialise() for t in ts],))[1]
    assert_close(tangent.materialise(), expected, scale=float(jnp.abs(expected).max()))
    assert qt.fallback_counts() == {}


def test_numpy_interop_of_results():
    with qt.fallback("error"):
        _, tangent = qt.jvp(lambda w: X @ w, (W,), (T,))
    assert np.asarray(qt.materialise(tangent)).shape == (16, 10)


# ---------------------------------------------------------------------------------------
# Careless arguments get errors that name the argument and the fix


def _sum_of_squares(w):
    return jnp.sum(w**2)


@pytest.mark.parametrize("argnums", ["0", 0.0, (), (0, "1")])
def test_argnums_must_be_ints(argnums):
    with pytest.raises(
        TypeError, match="`argnums` must be an int or a non-empty tuple"
    ):
        qt.grad(_sum_of_squares, argnums=argnums)(W)
    with pytest.raises(TypeError, match="`argnums` must be an int"):
        qt.partial_jvp(_sum_of_squares, (W,), (W,), argnums=argnums)


@pytest.mark.parametrize("entry", ["grad", "value_and_grad"])
def test_gradients_of_integer_inputs_are_refused(entry):
    # `jax.grad` refuses them too; returning float0 zeros would hide the mistake.
    transform = getattr(qt, entry)
    with pytest.raises(TypeError, match=f"`{entry}` differentiates argument 0 .*int32"):
        transform(_sum_of_squares)(jnp.arange(3))
    with pytest.raises(TypeError, match="argument 1 .*Cast it"):
        transform(lambda w, n: jnp.sum(w * n), argnums=1)(W[0], jnp.arange(10))
    with pytest.raises(TypeError, match=r"its leaf \['n'\] has dtype int32"):
        transform(lambda d: jnp.sum(d["w"]))({"w": W, "n": jnp.arange(2)})
    # Integer data in an argument that is not differentiated is fine.
    out = transform(lambda w, n: jnp.sum(w * n), argnums=0)(W[0], jnp.arange(10))
    grads = out[1] if entry == "value_and_grad" else out
    assert_close(grads, jnp.arange(10.0))
    # Python bools and ints are settings (as in an Equinox Module), not data.
    out = transform(lambda d: jnp.sum(d["w"]) * d["scale"])(
        {"w": W[0], "flag": True, "scale": 2}
    )
    grads = out[1] if entry == "value_and_grad" else out
    assert_close(grads["w"], jnp.full(W[0].shape, 2.0))


@pytest.mark.parametrize("entry", ["grad", "value_and_grad"])
def test_a_leaf_that_jax_cannot_trace_is_named_with_the_split(entry):
    # `jax.grad` of a whole Equinox model fails on its activation function; the
    # error says which leaf and how to split the model.
    mlp = eqx.nn.MLP(3, 2, 4, 1, key=jax.random.key(0))
    with pytest.raises(TypeError, match=r"its leaf \.activation is a .*eqx\.partition"):
        getattr(qt, entry)(lambda m: jnp.sum(m(jnp.ones(3))))(mlp)
    arrays, static = eqx.partition(mlp, eqx.is_inexact_array)
    grads = qt.grad(lambda a: jnp.sum(eqx.combine(a, static)(jnp.ones(3))))(arrays)
    expected = jax.grad(lambda a: jnp.sum(eqx.combine(a, static)(jnp.ones(3))))(arrays)
    for a, b in zip(jax.tree.leaves(grads), jax.tree.leaves(expected)):
        assert_close(a, b)


def test_jvp_needs_tuples_of_primals_and_tangents():
    with pytest.raises(
        TypeError,
        match=r"`primals` as a tuple or list.*got an array"
        r" float32\[12, 10\].*jvp\(fn, \(x,\), \(t,\)\)",
    ):
        qt.jvp(_sum_of_squares, W, (T,))
    with pytest.raises(TypeError, match="`tangents` as a tuple or list.*got LowRank"):
        qt.jvp(_sum_of_squares, (W,), T)
    with pytest.raises(TypeError, match="`partial_jvp` takes `primals`"):
        qt.partial_jvp(_sum_of_squares, W, (T,))


@pytest.mark.parametrize("entry", ["jvp", "vjp", "grad", "value_and_grad"])
def test_has_aux_needs_a_pair(entry):
    call = {
        "jvp": lambda f: qt.jvp(f, (W,), (T.materialise(),), has_aux=True),
        "vjp": lambda f: qt.vjp(f, W, has_aux=True),
        "grad": lambda f: qt.grad(f, has_aux=True)(W),
        "value_and_grad": lambda f: qt.value_and_grad(f, has_aux=True)(W),
    }[entry]
    with pytest.raises(
        TypeError,
        match=rf"`{entry}` was given `has_aux=True`.*returned an array float32\[\]",
    ):
        call(_sum_of_squares)
    with pytest.raises(TypeError, match="returned a tuple of 3 entries"):
        call(lambda w: (jnp.sum(w), 1, 2))
    out = call(lambda w: (jnp.sum(w), "aux"))
    assert (out[0][1] if entry == "value_and_grad" else out[-1]) == "aux"
