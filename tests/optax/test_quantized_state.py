"""`quantized_state`: its bytes, its code against a linear int8 code on moments that
span eight orders of magnitude, a training run against float32 state, and its
composition with `projected`."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from hypothesis import given, settings, strategies as st

import quax_tangents as qt
import quax_tangents.optax as qto
from quax_tangents.optax._quantized_state import _block_noise


def _state_bytes(tree) -> int:
    total = 0
    for leaf in jax.tree.leaves(tree):
        total += leaf.size * jnp.dtype(leaf.dtype).itemsize
    return total


def _llama_like(dtype, hidden=768, inter=2048, layers=12, vocab=32000):
    """The parameter shapes of a 130M Llama (stacked blocks), abstract."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, dtype)  # noqa: E731
    return {
        "embed": s(vocab, hidden),
        "head": s(hidden, vocab),
        "final_norm": s(hidden),
        "blocks": {
            "attn_norm": s(layers, hidden),
            "mlp_norm": s(layers, hidden),
            **{k: s(layers, hidden, hidden) for k in ("q", "k", "v", "o")},
            "gate": s(layers, hidden, inter),
            "up": s(layers, hidden, inter),
            "down": s(layers, inter, hidden),
        },
    }


@pytest.mark.parametrize("dtype, limit", [(jnp.float32, 0.27), (jnp.bfloat16, 0.53)])
def test_state_bytes_of_a_llama_sized_tree(dtype, limit):
    params = _llama_like(dtype)
    dense = jax.eval_shape(optax.adam(1e-3).init, params)
    coded = jax.eval_shape(qto.quantized_state(optax.adam(1e-3)).init, params)
    ratio = _state_bytes(coded) / _state_bytes(dense)
    assert ratio <= limit, ratio
    # The norms (768 elements) are coded too; a leaf smaller than a block is not.
    small = jax.eval_shape(
        qto.quantized_state(optax.adam(1e-3)).init,
        {"b": jax.ShapeDtypeStruct((100,), dtype)},
    )
    assert small.inner[0].mu["b"].dtype == dtype


def _moments(rng, shape=(8, 1024)):
    """Adam's moments whose second moment spans 1e-8 to 1 within every block, and a
    first moment on its square-root scale, with random signs."""
    nu = 10.0 ** rng.uniform(-8, 0, shape)
    mu = rng.choice([-1.0, 1.0], shape) * np.sqrt(nu) * rng.uniform(0.2, 1.0, shape)
    return jnp.asarray(mu, jnp.float32), jnp.asarray(nu, jnp.float32)


def _linear_int8(x):
    return qt.quantize(x, bits=8, block_size=256).materialise()


def _adam_direction(mu, nu, eps=1e-8):
    return mu / (jnp.sqrt(nu) + eps)


def test_log_code_keeps_moments_that_linear_int8_loses():
    mu, nu = _moments(np.random.default_rng(0))
    exact = _adam_direction(mu, nu)

    linear = _adam_direction(_linear_int8(mu), _linear_int8(nu))
    logarithmic = _adam_direction(
        qto.log_quantize(mu).decode(), qto.log_quantize(nu).decode()
    )
    linear_error = jnp.abs(linear - exact) / jnp.abs(exact)
    log_error = jnp.abs(logarithmic - exact) / jnp.abs(exact)
    # Linear int8 rounds the small moments to zero: the direction of those entries
    # is `mu / eps`, thousands of times too large, or zero where mu went too.
    assert float(jnp.mean(linear_error >= 0.5)) > 0.5
    assert float(jnp.max(linear_error)) > 1e3
    # The logarithmic code keeps every entry within 1/17 in each moment: at most
    # (1 + 1/17) / (1 - 1/17)**0.5 - 1 = 0.0914 in the direction.
    assert float(jnp.max(log_error)) < 0.0915


def test_adam_step_on_wide_moments():
    # The same through the transformation: one Adam step from a state whose moments
    # span eight orders of magnitude, stored as codes, against the exact step.
    rng = np.random.default_rng(1)
    mu, nu = _moments(rng)
    # Gradients of the first moment's signs, so that no entry cancels to near zero
    # (where any relative error is unbounded).
    grads = jnp.sign(mu) * jnp.asarray(
        rng.uniform(0.5, 1.5, mu.shape) * np.sqrt(nu), jnp.float32
    )
    exact_tx = optax.scale_by_adam()
    exact_state = exact_tx.init(mu)._replace(mu=mu, nu=nu, count=jnp.array(100))
    expected, _ = exact_tx.update(grads, exact_state)

    tx = qto.quantized_state(optax.scale_by_adam(), stochastic=False)
    state = tx.init(mu)
    inner = state.inner._replace(
        mu=qto.log_quantize(mu), nu=qto.log_quantize(nu), count=jnp.array(100)
    )
    got, state = jax.jit(tx.update)(grads, state._replace(inner=inner))
    error = jnp.abs(got - expected) / jnp.abs(expected)
    assert float(jnp.max(error)) < 0.08
    assert isinstance(state.inner.nu, qto.LogQuantized)
    assert state.inner.nu.codes.dtype == jnp.uint8


@settings(deadline=None, max_examples=15)
@given(
    rows=st.integers(1, 3),
    cols=st.sampled_from([1, 7, 78, 256, 300, 600]),
    low=st.integers(-9, -1),
    signed=st.booleans(),
)
def test_round_to_nearest_error_bound(rows, cols, low, signed):
    # Every entry within half a level of its value down to the code's floor (the
    # smallest level, 1.25 * 2**-32 of the block's largest when non-negative,
    # 1.25 * 2**-16 when signed); below it, within the floor. Half a level is at
    # most 1/16 of the octave's start (eight levels per octave), 1/17 of the value.
    rng = np.random.default_rng(rows * 1000 + cols)
    x = 10.0 ** rng.uniform(low, 0, (rows, cols))
    if signed:
        x = x * rng.choice([-1.0, 1.0], x.shape)
    x = jnp.asarray(x, jnp.float32)
    coded = qto.log_quantize(x, 256)
    decoded = coded.decode()
    assert decoded.shape == x.shape and decoded.dtype == x.dtype
    blocks = np.asarray(jnp.abs(x)).reshape(rows, -1)
    block = coded.codes.shape[-1]
    largest = np.zeros_like(blocks)
    for start in range(0, cols, block):
        part = blocks[:, start : start + block]
        largest[:, start : start + block] = part.max(axis=1, keepdims=True)
    is_signed = np.zeros_like(blocks, bool)
    xs = np.asarray(x)
    for start in range(0, cols, block):
        part = xs[:, start : start + block]
        is_signed[:, start : start + block] = (part < 0).any(axis=1, keepdims=True)
    floor = largest * np.where(is_signed, 1.25 * 2.0**-16, 1.25 * 2.0**-32)
    error = np.abs(np.asarray(decoded) - xs)
    kept = blocks >= floor
    assert np.all(error[kept] <= blocks[kept] / 17 * 1.0001)
    assert np.all(error[~kept] <= floor[~kept])


@settings(deadline=None, max_examples=15)
@given(
    layers=st.integers(1, 4),
    rows=st.integers(1, 19),
    cols=st.sampled_from([1, 7, 256, 300]),
    signed=st.booleans(),
)
def test_a_stack_stores_its_rows_padded_and_decodes_each_slice_alone(
    layers, rows, cols, signed
):
    # A stack's codes hold rows padded to a multiple of 8, so that a TPU keeps the
    # stack dim outermost; the numbers are those of each matrix encoded alone, and
    # a slice of the codes decodes as `layerwise` takes it (the stack's static
    # shape, one layer's codes).
    rng = np.random.default_rng(layers * 10_000 + rows * 100 + cols)
    x = rng.uniform(0.1, 1.0, (layers, rows, cols))
    if signed:
        x = x * rng.choice([-1.0, 1.0], x.shape)
    x = jnp.asarray(x, jnp.float32)
    stack = qto.log_quantize(x)
    padded = -(-rows // 8) * 8
    assert stack.codes.shape[:2] == (layers, padded)
    assert stack.scales.shape[:2] == (layers, padded)
    np.testing.assert_array_equal(stack.scales[:, rows:], 0.0)
    decoded = stack.decode()
    assert decoded.shape == x.shape
    for layer in range(layers):
        alone = qto.log_quantize(x[layer]).decode()
        np.testing.assert_array_equal(decoded[layer], alone)
        one = jax.tree.map(lambda a, i=layer: a[i : i + 1], stack)
        np.testing.assert_array_equal(one.decode()[0], alone)


def test_noise_of_the_unpadded_shape_is_refused_naming_the_codes_shape():
    x = jnp.ones((2, 5, 600), jnp.float32)
    with pytest.raises(ValueError, match=r"`noise`.*\[2, 8, 2, 300\]"):
        qto.log_quantize(x, 300, noise=jnp.zeros((2, 5, 2, 300)))
    noise = jnp.full((2, 8, 2, 300), 0.5)
    assert qto.log_quantize(x, 300, noise=noise).decode().shape == x.shape


# Few examples: each new width compiles the codec anew (about 0.3 s).
@settings(deadline=None, max_examples=10)
@given(width=st.integers(1, 5000), block_size=st.sampled_from([2, 7, 300, 512, 2048]))
def test_a_row_is_split_into_the_fewest_blocks_of_one_size(width, block_size):
    # As few blocks as hold at most `block_size` each, of one size: padded by less
    # than one element per block, or, for a block wider than 128 where `block_size`
    # is a multiple of 128, rounded up to a multiple of 128 (a TPU's lanes).
    coded = qto.log_quantize(jnp.ones((3, width)), block_size)
    _, count, block = coded.codes.shape
    assert block <= block_size and count == -(-width // block_size)
    padding = count * block - width
    if block > 128 and block_size % 128 == 0:
        assert block % 128 == 0 and 0 <= padding < count * 128
    else:
        assert 0 <= padding < count
    assert coded.scales.shape == (3, count)
    np.testing.assert_array_equal(coded.decode(), np.ones((3, width)))


def test_a_width_of_768_in_blocks_of_512_is_two_blocks_of_384():
    assert qto.log_quantize(jnp.ones((2, 768)), 512).codes.shape == (2, 2, 384)
    assert qto.log_quantize(jnp.ones((2, 32000)), 2048).codes.shape == (2, 16, 2048)


@pytest.mark.parametrize(
    "x, kwargs, error, match",
    [
        (jnp.ones(8), {"block_size": 0}, ValueError, "`block_size` must be at least 2"),
        (jnp.ones(8), {"block_size": 2.5}, TypeError, "`block_size` must be an int"),
        (jnp.ones(()), {}, ValueError, "`x` must be a floating array with at least"),
        (jnp.ones(8, jnp.int32), {}, ValueError, r"x.astype\(jnp.float32\)"),
    ],
)
def test_bad_input_to_log_quantize_names_the_argument(x, kwargs, error, match):
    with pytest.raises(error, match=match):
        qto.log_quantize(x, **kwargs)


def test_stochastic_rounding_is_unbiased():
    # A value between two levels decodes to it on average: Adam's 0.1% steps of the
    # second moment survive where rounding to nearest would undo them.
    # Every block (a row) holds 1.0 and 0.3s, which fall between two levels.
    x = jnp.full((64, 256), 0.3, jnp.float32).at[:, 0].set(1.0)
    nearest = qto.log_quantize(x).decode()[:, 1:]
    assert float(jnp.abs(jnp.mean(nearest) - 0.3)) > 3e-3
    total = sum(
        qto.log_quantize(x, noise=_block_noise((64, 1, 256), jnp.int32(s))).decode()
        for s in range(100)
    )
    assert float(jnp.abs(jnp.mean(total[:, 1:]) / 100 - 0.3)) < 3e-4


def test_a_jitted_init_encodes_at_run_time_not_by_constant_folding():
    # Folded by XLA element by element, the encoding of a 1B model's zero moments
    # took minutes to compile; the compiled init computes it (its block maxima are
    # reductions in the program), and gives what the eager init gives.
    params = {"w": jnp.zeros((64, 1024)), "b": jnp.zeros(8)}
    tx = qto.quantized_state(optax.adam(1e-3))
    compiled = jax.jit(tx.init).lower(params).compile()
    assert " reduce(" in compiled.as_text()
    jitted, eager = compiled(params), tx.init(params)
    assert jax.tree.structure(jitted) == jax.tree.structure(eager)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(eager)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_the_rounding_noise_is_a_hash_of_each_position_and_the_seed():
    # Uniform in [0, 1), a function of the row-major position alone (the same
    # numbers whatever the blocked shape), different for another seed.
    shape = (3, 5, 2, 16)
    noise = np.asarray(_block_noise(shape, jnp.int32(7)))
    flat = np.asarray(_block_noise((480,), jnp.int32(7)))
    np.testing.assert_array_equal(noise.reshape(-1), flat)
    assert noise.min() >= 0.0 and noise.max() < 1.0
    assert abs(float(noise.mean()) - 0.5) < 0.05
    assert len(np.unique(noise)) == noise.size
    other = np.asarray(_block_noise(shape, jnp.int32(8)))
    assert np.mean(other == noise) < 0.01


def _mlp_problem():
    """A teacher network's outputs plus noise, fitted by a small MLP."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((1024, 32)), jnp.float32)
    teacher = rng.standard_normal((32, 64)) / np.sqrt(32)
    y = np.tanh(np.asarray(x) @ teacher) @ (rng.standard_normal((64, 4)) / 4)
    y = jnp.asarray(y + 0.3 * rng.standard_normal(y.shape), jnp.float32)
    params = {
        "w1": jnp.asarray(rng.standard_normal((32, 64)) / np.sqrt(32), jnp.float32),
        "b1": jnp.zeros(64),
        "w2": jnp.asarray(rng.standard_normal((64, 4)) / 8, jnp.float32),
    }

    def loss(p):
        return jnp.mean((jnp.tanh(x @ p["w1"] + p["b1"]) @ p["w2"] - y) ** 2)

    return params, loss


def _train(tx, params, loss, steps=300):
    state = tx.init(params)

    def step(carry, _):
        params, state = carry
        value, grads = jax.value_and_grad(loss)(params)
        updates, state = tx.update(grads, state, params)
        return (optax.apply_updates(params, updates), state), value

    (params, state), losses = jax.jit(
        lambda p, s: jax.lax.scan(step, (p, s), length=steps)
    )(params, state)
    return float(loss(params)), state


def test_training_with_8_bit_state_ends_within_2_percent_of_float32():
    params, loss = _mlp_problem()
    start = float(loss(params))
    dense, _ = _train(optax.adam(3e-3), params, loss)
    coded_tx = qto.quantized_state(optax.adam(3e-3), block_size=256)
    coded, state = _train(coded_tx, params, loss)
    assert dense < 0.1 * start  # it trained
    assert abs(coded - dense) <= 0.02 * dense, (coded, dense)
    # In blocks of at most 256, w1 (2048 elements) and w2 (256) are stored as codes;
    # b1 (64) is not.
    adam_state = state.inner[0]
    assert isinstance(adam_state.nu["w1"], qto.LogQuantized)
    assert isinstance(adam_state.nu["w2"], qto.LogQuantized)
    assert not isinstance(adam_state.nu["b1"], qto.LogQuantized)


def _marked(g, projector):
    return qt.LowRank(
        jnp.asarray(projector), jnp.asarray(g.T @ projector), projector_side="left"
    )


def test_composes_with_projected_either_way():
    rng = np.random.default_rng(2)
    shape, rank = (16, 600), 4
    params = {"w": jnp.zeros(shape), "b": jnp.zeros(8)}
    projector = np.linalg.qr(rng.standard_normal((16, rank)))[0].astype(np.float32)
    base = optax.chain(optax.scale_by_adam(), optax.scale(-0.1))
    inside = qto.projected(
        qto.quantized_state(base, stochastic=False), rank=rank, refresh_every=100
    )
    outside = qto.quantized_state(
        qto.projected(base, rank=rank, refresh_every=100), stochastic=False
    )
    states = [tx.init(params) for tx in (inside, outside)]
    for _ in range(3):
        g = rng.standard_normal(shape).astype(np.float32)
        grads = {"w": _marked(g, projector), "b": jnp.ones(8)}
        results = [
            jax.jit(tx.update)(grads, state)
            for tx, state in zip((inside, outside), states)
        ]
        (u_in, s_in), (u_out, s_out) = results
        np.testing.assert_allclose(u_in["w"].right, u_out["w"].right, rtol=1e-6)
        states = [s_in, s_out]
    for state in states:
        # The projectors stay exact; the factor's moments (600 x 4) are codes.
        np.testing.assert_array_equal(qto.projectors(state)["w"].matrix, projector)
    assert isinstance(states[1].inner.base_state[0].nu["w"], qto.LogQuantized)
    assert isinstance(states[0].base_state.inner[0].nu["w"], qto.LogQuantized)


def test_bits_other_than_8_are_refused():
    with pytest.raises(ValueError, match="`bits` must be 8"):
        qto.quantized_state(optax.adam(1e-3), bits=4)


def _stacked_case():
    """A stacked leaf `(3, 16, 16)` (a scanned model's blocks), projected, and a
    small leaf that is not."""
    params = {
        "w": jax.random.normal(jax.random.key(0), (3, 16, 16)) / 4,
        "b": jnp.ones(16),
    }
    x = jax.random.normal(jax.random.key(1), (5, 16))

    def loss(p):
        def layer(h, w):
            return jnp.tanh(h @ w + p["b"]), None

        h, _ = jax.lax.scan(layer, x, p["w"])
        return jnp.sum(h**2)

    return params, loss, {"w": True, "b": False}


def _composed(order: str, project, layerwise: bool = False):
    kw = dict(rank=4, learning_rate=1e-3, project=project)
    tx = {
        "projected outside": qto.projected(
            qto.quantized_state(optax.scale_by_adam()), **kw
        ),
        "quantized outside": qto.quantized_state(
            qto.projected(optax.scale_by_adam(), **kw)
        ),
    }[order]
    return qto.layerwise(tx, layers=3) if layerwise else tx


ORDERS = ["projected outside", "quantized outside"]


@pytest.mark.parametrize("order", ORDERS)
def test_a_stack_decoded_whole_is_refused_naming_the_default(order):
    # Outside `layerwise`, every layer's state of the stack would be decoded to
    # float32 at once: the composition that loses the saving is refused, and the
    # error names the pipeline that keeps it and the wrapper that fixes it.
    params, loss, project = _stacked_case()
    tx = _composed(order, project)
    state = tx.init(params)
    grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
    with pytest.raises(ValueError) as error:
        jax.jit(tx.update)(grads, state, params)
    message = str(error.value)
    assert "`['w']` (3 layers)" in message
    assert "qto.galore(" in message
    assert "qto.layerwise(..., layers=3)" in message


@pytest.mark.parametrize("order", ORDERS)
def test_a_stack_decoded_one_layer_at_a_time_is_taken(order):
    params, loss, project = _stacked_case()
    tx = _composed(order, project, layerwise=True)
    state = tx.init(params)
    grads = qt.grad(lambda p: loss(qto.mark(p, state)))(params)
    updates, _ = jax.jit(tx.update)(grads, state, params)
    assert isinstance(updates["w"], qt.LowRank) and updates["w"].batch_ndim == 1


def test_the_pipeline_and_unstacked_leaves_are_not_refused():
    # `qto.galore` decodes one layer at a time; a leaf without stack dims has one
    # layer's state to decode, so the plain composition takes it.
    params, loss, project = _stacked_case()
    opt = qto.galore(rank=4, learning_rate=1e-3, project=project)
    state = opt.init(params)
    _, grads = opt.value_and_grad(lambda p, _: loss(p))(params, state, jnp.zeros(1))
    updates, _ = jax.jit(opt.update)(grads, state, params)
    assert isinstance(updates["w"], qt.LowRank)
    flat = {"w": params["w"][0], "b": params["b"]}
    tx = _composed("projected outside", project)
    state = tx.init(flat)
    x = jnp.ones((5, 16))
    grads = qt.grad(lambda p: jnp.sum(jnp.tanh(x @ qto.mark(p, state)["w"]) ** 2))(flat)
    updates, _ = jax.jit(tx.update)(grads, state, flat)
    assert isinstance(updates["w"], qt.LowRank) and updates["w"].batch_ndim == 0
