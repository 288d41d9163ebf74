"""`quax_tangents.optax.layerwise`: the same updates and state as the transformation
it wraps, computed one slice of the stacked leaves at a time, with one slice's
intermediates only."""

import re

import jax
import jax.numpy as jnp
import optax
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents.optax._stacks import per_layer
from tests.helpers import assert_close, random_array, seeds
from tests.helpers.compilers import converts_slices_in_loops
from tests.helpers.fallback import projects_dense_gradients


def _params(seed: int, layers: int, extra_rows: int) -> dict:
    """A stacked model's leaves, a table whose rows `layers` may not divide, and a
    scalar."""
    return {
        "w": random_array(seed, (layers, 4, 6)),
        "norm": random_array(seed + 1, (layers, 4)),
        "table": random_array(seed + 2, (layers + extra_rows, 5)),
        "scale": jnp.asarray(0.5),
    }


def _transformations(layers: int) -> dict:
    small = dict(block_size=4, stochastic=False)
    return {
        "adam": optax.adam(0.1),
        "8-bit adam": qto.quantized_state(optax.adam(0.1), **small),
        "projected": qto.projected(
            optax.scale_by_adam(), rank=2, learning_rate=0.1, refresh_every=2
        ),
        "8-bit projected": qto.quantized_state(
            qto.projected(optax.scale_by_adam(), rank=2, learning_rate=0.1), **small
        ),
    }


def _compare(tx, layers: int, params: dict, grads: list) -> None:
    """Two steps of `layerwise(tx)` equal two steps of `tx`."""
    wrapped = qto.layerwise(tx, layers=layers)
    state = expected_state = tx.init(params)
    update, reference = jax.jit(wrapped.update), jax.jit(tx.update)
    for g in grads:
        # The reference runs `tx` on whole stacks, which `quantized_state` refuses
        # outside `layerwise` (test_quantized_state.py): allowed here as the
        # reference only.
        with per_layer():
            expected, expected_state = reference(g, expected_state, params)
        updates, state = update(g, state, params)
        jax.tree.map(assert_close, updates, expected, is_leaf=qto_leaf)
        jax.tree.map(assert_close, state, expected_state)


def qto_leaf(x) -> bool:
    return isinstance(x, qt.LowRank)


# Each example compiles two steps; a few cover the cuts (even, uneven, one layer).
@pytest.mark.parametrize("name", list(_transformations(1)))
@settings(max_examples=2, deadline=None)
@given(seed=seeds(), layers=st.integers(1, 3), extra_rows=st.integers(0, 2))
@projects_dense_gradients
def test_layerwise_equals_the_transformation_it_wraps(name, seed, layers, extra_rows):
    params = _params(seed, layers, extra_rows)
    grads = [
        jax.tree.map(lambda x, k=k: random_array(seed + 10 + k, x.shape), params)
        for k in range(2)
    ]
    _compare(_transformations(layers)[name], layers, params, grads)


def _scanned_loss(params, x):
    def layer(h, w):
        return jnp.tanh(h @ w), None

    h, _ = jax.lax.scan(layer, x, params["w"])
    return jnp.sum(h**2) + jnp.sum(params["table"] ** 2)


LAYERS = 3


def _projected_scanned_case(eight_bit=False):
    """(params, projected transformation, its state, marked gradients) of a scanned
    model: `w` stacked and projected, `table` dense."""
    params = {
        "w": random_array(0, (LAYERS, 6, 6)) / 2,
        "table": random_array(1, (7, 6)),
    }
    tx = qto.projected(
        optax.scale_by_adam(),
        rank=2,
        learning_rate=0.1,
        project={"w": True, "table": False},
    )
    if eight_bit:
        tx = qto.quantized_state(tx, block_size=4, stochastic=False)
    state = tx.init(params)
    x = random_array(2, (5, 6))
    with qt.fallback("error"):
        grads = qt.grad(
            lambda p: _scanned_loss(qto.mark(p, state, key=jax.random.key(3)), x)
        )(params)
    return params, tx, state, grads


@pytest.mark.parametrize("eight_bit", [False, True])
def test_projected_gradients_of_a_scanned_model(eight_bit):
    params, tx, _, grads = _projected_scanned_case(eight_bit)
    assert isinstance(grads["w"], qt.LowRank) and grads["w"].batch_ndim == 1
    _compare(tx, LAYERS, params, [grads])


def test_a_new_state_leaf_that_is_the_gradients_own_array_is_passed_through():
    # `projected` takes the gradient's projector as its new state: `layerwise`
    # returns that array itself, neither reading the old projector nor carrying a
    # projector-sized buffer through its loop.
    params, tx, state, grads = _projected_scanned_case()
    _, new_state = qto.layerwise(tx, layers=LAYERS).update(grads, state, params)
    _, expected = tx.update(grads, state, params)
    leaves = jax.tree.leaves(new_state)
    assert any(x is grads["w"].left for x in leaves)
    for a, b in zip(jax.tree.leaves(expected), leaves, strict=True):
        assert_close(a, b)


@projects_dense_gradients
def test_a_projected_matrix_without_layer_axis_goes_whole():
    # Its rows are not independent: cutting them would project each slice alone.
    params = {"w": random_array(0, (6, 8)), "v": random_array(1, (3, 4, 4))}
    grads = jax.tree.map(lambda x: random_array(2, x.shape), params)
    tx = qto.projected(optax.scale_by_adam(), rank=2, learning_rate=0.1)
    _compare(tx, 3, params, [grads])
    with pytest.raises(ValueError, match=r"\['w'\].*projects it as one matrix"):
        qto.layerwise(tx, layers=3, split={"w": True, "v": True}).update(
            grads, tx.init(params), params
        )


def test_split_naming_a_leaf_with_too_few_rows_raises():
    params = {"w": jnp.zeros((4, 3)), "b": jnp.zeros((2,))}
    tx = qto.layerwise(optax.adam(0.1), layers=4, split={"w": True, "b": True})
    with pytest.raises(ValueError, match=r"\['b'\].*fewer than layers=4 rows"):
        tx.update(params, tx.init(params), params)


def test_a_vector_goes_whole_and_the_state_layout_takes_one_init():
    # A vector has no layers. Cut into slices below `quantized_state`'s block it
    # would be stored another way than whole, which `layerwise` finds with one
    # more abstract `tx.init` per cut leaf; left whole, one `init` of a slice
    # gives the layout of every leaf.
    params = {
        "w": random_array(0, (4, 4, 8)),
        "v": random_array(1, (4, 8)),
        "norm": random_array(2, (16,)),
    }
    grads = jax.tree.map(lambda x: random_array(3, x.shape), params)
    tx = qto.quantized_state(optax.adam(0.1), block_size=8, stochastic=False)
    inits = []

    def init(p):
        inits.append(jax.tree.map(jnp.shape, p))
        return tx.init(p)

    counted = optax.GradientTransformationExtraArgs(init, tx.update)
    state = tx.init(params)
    with per_layer():
        expected, expected_state = tx.update(grads, state, params)
    updates, new_state = qto.layerwise(counted, layers=4).update(grads, state, params)
    assert [shapes["norm"] for shapes in inits] == [(16,)]
    jax.tree.map(assert_close, updates, expected)
    jax.tree.map(assert_close, new_state, expected_state)


@projects_dense_gradients
def test_the_update_of_one_slice_is_traced_once():
    # The loop's body replays the one trace that gives its shapes: `tx.update`'s
    # Python runs once per `layerwise` update, whatever the leaves and the cuts
    # (three times before: a probe of one slice, the whole tree's shapes, the body).
    params = _params(0, 3, 1)
    grads = jax.tree.map(lambda x: random_array(5, jnp.shape(x)), params)
    tx = _transformations(3)["8-bit projected"]
    calls = []

    def update(updates, state, params=None):
        calls.append(None)
        return tx.update(updates, state, params)

    counted = optax.GradientTransformation(tx.init, update)
    state = tx.init(params)
    with per_layer():
        expected, expected_state = tx.update(grads, state, params)
    updates, new_state = qto.layerwise(counted, layers=3).update(grads, state, params)
    assert len(calls) == 1
    jax.tree.map(assert_close, updates, expected, is_leaf=qto_leaf)
    jax.tree.map(assert_close, new_state, expected_state)


def test_an_update_that_changes_a_slices_rows_raises():
    # A slice's update must be that slice's rows of the whole update.
    params = {"w": random_array(0, (3, 4, 6))}
    swapped = optax.GradientTransformation(
        lambda p: optax.EmptyState(),
        lambda u, s, p=None: (jax.tree.map(lambda x: jnp.swapaxes(x, 0, -1), u), s),
    )
    tx = qto.layerwise(swapped, layers=3)
    with pytest.raises(
        ValueError, match=r"shape \[6, 4, 1\], not 1 rows.*of its leaf's 3"
    ):
        tx.update(params, tx.init(params), params)


def test_layers_must_be_a_positive_int():
    with pytest.raises(ValueError, match="layers"):
        qto.layerwise(optax.adam(0.1), layers=0)
    with pytest.raises(TypeError, match="tx"):
        qto.layerwise(lambda x: x, layers=2)


def _f32_buffers(text: str, shape: tuple) -> int:
    dims = ",".join(str(d) for d in shape)
    return len(re.findall(rf"f32\[{dims}\]", text))


@converts_slices_in_loops
def test_the_8_bit_state_is_decoded_one_layer_at_a_time():
    # Without `layerwise`, the update decodes every layer's moments to float32 at
    # once: the compiled update holds float32 arrays of the stacked shape. Read from
    # XLA:CPU's compiled HLO (this suite's backend), from JAX 0.11.
    layers, shape = 4, (4, 64, 256)
    params = {"w": jnp.zeros(shape, jnp.bfloat16)}
    tx = qto.quantized_state(optax.adam(0.1))
    state = jax.eval_shape(tx.init, params)

    def hlo(transformation) -> str:
        lowered = jax.jit(transformation.update, donate_argnums=1).lower(
            params, state, params
        )
        return lowered.compile().as_text()

    assert _f32_buffers(hlo(tx), shape) > 0
    assert _f32_buffers(hlo(qto.layerwise(tx, layers=layers)), shape) == 0
