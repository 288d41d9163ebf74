"""A weight stored with more dims than its matrix, marked through its matrix view
(`quax_tangents._marks._matrix_view`): its gradient comes back as the `LowRank` of the
matrix view under the entry points, and as the same numbers, dense and in the stored
shape, under plain JAX."""

import math
import string

import jax
import jax.numpy as jnp
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
from quax_tangents._marks._matrix_view import to_matrix
from tests.helpers import assert_close, random_array, seeds
from tests.helpers.stacked import orthonormal, project


R = 1


@st.composite
def _viewed_weights(draw):
    """A stored weight `(*batch, *rows, *cols)` (every dim at least 2, so that the
    split into rows and columns is the only one), its matrix view, and the einsum
    that contracts `x` with its rows or with its columns."""
    batch = [draw(st.integers(2, 3)) for _ in range(draw(st.integers(0, 1)))]
    rows = [draw(st.integers(2, 3)) for _ in range(draw(st.integers(1, 2)))]
    cols = [draw(st.integers(2, 3)) for _ in range(draw(st.integers(1, 2)))]
    letters = iter(string.ascii_lowercase.replace("t", ""))
    b, r, c = ("".join(next(letters) for _ in dims) for dims in (batch, rows, cols))
    contract_rows = draw(st.booleans())
    inner, outer = (r, c) if contract_rows else (c, r)
    equation = f"{b}t{inner},{b}{r}{c}->{b}t{outer}"
    x_shape = (*batch, 2, *(rows if contract_rows else cols))
    stored = (*batch, *rows, *cols)
    m, n = math.prod(rows), math.prod(cols)
    return stored, (*batch, m, n), equation, x_shape


def _loss(w, x, equation):
    return jnp.sum(jnp.tanh(jnp.einsum(equation, x, w)) ** 2)


def _marked_loss(matrix_shape, projector):
    def loss(w, x, equation):
        matrix = to_matrix(w, matrix_shape)
        marked = qt.projected_cotangent(matrix, R, projector=projector)
        return _loss(marked.reshape(w.shape), x, equation)

    return loss


@settings(deadline=None, max_examples=8)
@given(_viewed_weights(), seeds())
def test_the_gradient_is_the_projection_of_the_matrix_view(case, seed):
    stored, matrix_shape, equation, x_shape = case
    *batch, m, n = matrix_shape
    w, x = random_array(seed, stored), random_array(seed + 1, x_shape)
    projector = orthonormal(seed + 2, (*batch, min(m, n), R))
    side = "left" if m <= n else "right"
    marked = _marked_loss(matrix_shape, projector)
    with qt.fallback("error"):
        grad = qt.grad(marked)(w, x, equation)
    assert isinstance(grad, qt.LowRank) and grad.shape == matrix_shape
    assert grad.projector_side == side and grad.batch_ndim == len(batch)
    dense = jax.grad(_loss)(w, x, equation).reshape(matrix_shape)
    assert_close(grad, project(dense, projector, side))
    # Plain JAX: the same projection, dense and in the stored shape.
    plain = jax.grad(marked)(w, x, equation)
    assert plain.shape == stored
    assert_close(plain.reshape(matrix_shape), grad)


def test_vjp_and_value_and_grad_return_the_matrix_view():
    w, x = random_array(0, (6, 2, 3)), random_array(1, (4, 6))
    projector = orthonormal(2, (6, R))
    marked = _marked_loss((6, 6), projector)
    with qt.fallback("error"):
        value, grad = qt.value_and_grad(marked)(w, x, "td,dhk->thk")
        out, pullback = qt.vjp(lambda w: marked(w, x, "td,dhk->thk"), w)
        (pulled,) = pullback(jnp.ones_like(out))
    assert_close(value, _loss(w, x, "td,dhk->thk"))
    for g in (grad, pulled):
        assert isinstance(g, qt.LowRank) and g.shape == (6, 6)
        assert_close(g, grad)


def test_a_jitted_loss_and_forward_over_reverse():
    w, x = random_array(0, (6, 2, 3)), random_array(1, (4, 6))
    projector = orthonormal(2, (6, R))
    marked = _marked_loss((6, 6), projector)
    jitted = jax.jit(marked, static_argnums=2)
    with qt.fallback("error"):
        grad = qt.grad(lambda w: jitted(w, x, "td,dhk->thk"))(w)
    assert isinstance(grad, qt.LowRank) and grad.shape == (6, 6)
    dense = jax.grad(_loss)(w, x, "td,dhk->thk").reshape(6, 6)
    assert_close(grad, project(dense, projector, "left"))
    # The dense pullback of plain JAX can itself be differentiated.
    tangent = random_array(3, w.shape)
    _, hvp = jax.jvp(lambda w: jax.grad(marked)(w, x, "td,dhk->thk"), (w,), (tangent,))
    assert hvp.shape == w.shape


def test_a_weight_with_no_such_matrix_view_is_refused():
    with pytest.raises(ValueError, match="no matrix view"):
        to_matrix(jnp.zeros((6, 2, 3)), (6, 5))


def test_another_use_of_the_stored_weight_is_counted_and_dense():
    # Weight decay on the stored weight, outside the mark: its dense cotangent is
    # added to the view's, in the stored shape.
    w, x = random_array(0, (6, 2, 3)), random_array(1, (4, 6))
    projector = orthonormal(2, (6, R))
    marked = _marked_loss((6, 6), projector)

    def loss(w):
        return marked(w, x, "td,dhk->thk") + jnp.sum(w**2)

    with qt.fallback("error"), pytest.raises(qt.DensificationError):
        qt.grad(loss)(w)
    with pytest.warns(qt.DensificationWarning):
        grad = qt.grad(loss)(w)
    assert isinstance(grad, jax.Array) and grad.shape == w.shape
    assert_close(grad, jax.grad(loss)(w))
