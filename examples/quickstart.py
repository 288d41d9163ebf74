"""Quickstart: compress a real gradient, push a low-rank tangent through an MLP, and
get a compressed gradient straight out of `quax_tangents.grad`.

Run it with

    python examples/quickstart.py

It trains a small MLP (64 -> 128 -> 10) on scikit-learn's digits for a few SGD steps,
so that the gradient it compresses is a real one. It takes well under a minute on two
CPU cores, most of it compilation.
"""

import argparse
import functools

import jax
import jax.numpy as jnp
import numpy as np
from sklearn.datasets import load_digits

import quax_tangents as qt


# ---------------------------------------------------------------------------------
# A plain JAX MLP: params is a list of (weight, bias) pairs.


def init_mlp(rng, sizes):
    """Initialises an MLP with LeCun-normal weights and zero biases.

    **Arguments:**

    - `rng`: a `numpy.random.Generator`. NumPy rather than `jax.random`, because on
        CPU each new shape drawn with `jax.random` costs a compilation.
    - `sizes`: layer widths, input first, e.g. `(64, 128, 10)`.

    **Returns:**

    A list of `(weight, bias)` pairs, `weight` of shape `(fan_in, fan_out)`.
    """
    return [
        (
            jnp.asarray(rng.standard_normal((m, n)) / np.sqrt(m), jnp.float32),
            jnp.zeros(n),
        )
        for m, n in zip(sizes[:-1], sizes[1:])
    ]


def mlp(params, x):
    """The logits of the MLP (tanh hidden layers) on a batch `x` of shape `(b, 64)`."""
    *hidden, (w_out, b_out) = params
    for w, b in hidden:
        x = jnp.tanh(x @ w + b)
    return x @ w_out + b_out


def first_preactivation(params, x):
    """`x @ w1 + b1`: the part of the MLP before the first nonlinearity."""
    w, b = params[0]
    return x @ w + b


def loss(params, x, y):
    """Mean softmax cross-entropy."""
    logits = mlp(params, x)
    return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits), y[:, None], 1))


def loss_with_compressed_w1(params, x, y):
    """`loss`, but the cotangent reaching the first weight is compressed to rank 4.

    `compress_cotangent` is the identity on the forward pass; under
    `quax_tangents.grad` the gradient of `w1` comes back as a `LowRank`.
    """
    (w1, b1), *rest = params
    w1 = qt.compress_cotangent(w1, functools.partial(qt.low_rank, rank=4))
    return loss([(w1, b1), *rest], x, y)


def kind(x):
    """The type name of a compressed value, or "dense Array"."""
    return type(x).__name__ if isinstance(x, qt.CompressedArray) else "dense Array"


def relative_error(approx, exact):
    """`||approx - exact||_F / ||exact||_F`, with `approx` materialised if compressed."""
    approx = qt.materialise(approx)
    return float(jnp.linalg.norm(approx - exact) / jnp.linalg.norm(exact))


# ---------------------------------------------------------------------------------


def main(steps: int = 30, learning_rate: float = 0.5, seed: int = 0) -> None:
    """Trains briefly, then prints the compression table, the JVP and the gradient.

    **Arguments:**

    - `steps`: full-batch SGD steps before the gradient is taken.
    - `learning_rate`: the SGD step size.
    - `seed`: seeds the initialisation and the random tangent direction.
    """
    digits = load_digits()
    x = jnp.asarray(digits.data / 16.0, jnp.float32)  # pixels are 0..16
    y = jnp.asarray(digits.target)
    rng = np.random.default_rng(seed)
    params = init_mlp(rng, (64, 128, 10))

    # A few full-batch SGD steps, so the gradient below is a mid-training gradient
    # with real structure rather than one at a random initialisation.
    @jax.jit
    def sgd_step(params):
        value, grads = jax.value_and_grad(loss)(params, x, y)
        return jax.tree.map(lambda p, g: p - learning_rate * g, params, grads), value

    for step in range(steps):
        params, value = sgd_step(params)
        if step == 0:
            print(f"loss at step 0: {float(value):.3f}")
    print(f"loss after {steps} SGD steps: {float(loss(params, x, y)):.3f}\n")

    # 1. Compress the dense gradient of the first weight matrix with each compressor.
    grad_w1 = jax.grad(loss)(params, x, y)[0][0]
    print(
        f"gradient of w1: {grad_w1.dtype}{list(grad_w1.shape)}, "
        f"{grad_w1.nbytes} bytes dense\n"
    )
    compressors = [
        ("rank=1", functools.partial(qt.low_rank, rank=1)),
        ("rank=4", functools.partial(qt.low_rank, rank=4)),
        ("rank=16", functools.partial(qt.low_rank, rank=16)),
        ("k=1%", functools.partial(qt.top_k, k=0.01)),
        ("k=10%", functools.partial(qt.top_k, k=0.10)),
        ("bits=8", functools.partial(qt.quantize, bits=8)),
        ("bits=4", functools.partial(qt.quantize, bits=4)),
        ("per-tensor", qt.sign_norm),
        ("block=256", functools.partial(qt.sign_norm, block_size=256)),
    ]
    header = (
        f"{'type':<10} {'settings':<11} {'bytes':>7} {'ratio':>7} {'rel. error':>10}"
    )
    print(header)
    print("-" * len(header))
    for settings, compress in compressors:
        c = compress(grad_w1)
        print(
            f"{kind(c):<10} {settings:<11} {c.nbytes:>7} "
            f"{c.compression_ratio:>6.1f}x {relative_error(c, grad_w1):>10.4f}"
        )
    print()

    # 2. Forward mode: a rank-4 tangent for w1, nothing for the other inputs. `None`
    # gives those inputs JAX's symbolic zero tangents, so no dense zeros meet the
    # compressed tangent and force it dense.
    direction = qt.low_rank(
        jnp.asarray(rng.standard_normal(grad_w1.shape), jnp.float32), rank=4
    )
    tangents = ([(direction, None), (None, None)], None)

    def dense_jvp(fn):
        # The reference: jax.jvp with the tangent materialised and dense zeros for
        # every other input.
        zeros = jax.tree.map(jnp.zeros_like, (params, x))
        zeros[0][0] = (direction.materialise(), zeros[0][0][1])
        return jax.jvp(fn, (params, x), zeros)[1]

    # Up to the first nonlinearity the tangent is `x @ direction`: still rank 4.
    _, t_hidden = qt.jvp(first_preactivation, (params, x), tangents)
    t_hidden_ref = dense_jvp(first_preactivation)
    print(
        f"JVP up to the first tanh: tangent is {kind(t_hidden)} "
        f"(rank {t_hidden.rank}, {t_hidden.dtype}{list(t_hidden.shape)}), "
        f"rel. error vs jax.jvp {relative_error(t_hidden, t_hidden_ref):.1e}"
    )

    # Through the whole MLP the tanh densifies the tangent. "silent" only counts
    # instead of warning; `qt.fallback("error")` would raise instead.
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        _, t_out = qt.jvp(mlp, (params, x), tangents)
    t_out_ref = dense_jvp(mlp)
    print(
        f"JVP through the whole MLP: tangent is {kind(t_out)} "
        f"({t_out.dtype}{list(t_out.shape)}), "
        f"rel. error vs jax.jvp {relative_error(t_out, t_out_ref):.1e}"
    )
    print(f"fallback counts (primitive, type): {qt.fallback_counts()}")
    print(
        "why: tanh's JVP scales the tangent elementwise by the full matrix "
        "1 - tanh(z)**2 (JAX does it with a mul and an add), and the elementwise "
        "product of a rank-4 matrix with a full matrix is in general full rank, so "
        "the tangent has to become dense there.\n"
    )

    # 3. Reverse mode: the gradient of w1 comes out of `qt.grad` already compressed.
    # It is `low_rank(grad_w1, rank=4)` (same default key), so the error matches the
    # rank=4 row of the table.
    grads = qt.grad(loss_with_compressed_w1)(params, x, y)
    g_w1 = grads[0][0]
    print(
        f"qt.grad with compress_cotangent: gradient of w1 is {kind(g_w1)} "
        f"(rank {g_w1.rank}), {g_w1.nbytes} bytes instead of {grad_w1.nbytes}, "
        f"rel. error vs the dense gradient {relative_error(g_w1, grad_w1):.4f}; "
        f"other gradients stay dense ({kind(grads[0][1])})"
    )


if __name__ == "__main__":
    # The description is the docstring's first paragraph: its first sentence.
    description = " ".join(__doc__.split("\n\n")[0].split())
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--steps", type=int, default=30, help="SGD steps first")
    parser.add_argument("--learning-rate", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    main(steps=args.steps, learning_rate=args.learning_rate, seed=args.seed)
