"""`@differentiable` classes: field kinds, the generated Tangent, `move`, pytree round
trips through JAX's transformations, derivatives, user-declared Tangents and errors."""

import dataclasses
import enum
import functools as ft
import pickle
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal, NamedTuple

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
import numpy as np
import pytest
from hypothesis import given, strategies as st
from jax import lax

import quax_tangents as qt
from quax_tangents import (
    Differentiable,
    NoDerivative,
    Static,
    differentiable,
)


def assert_trees_close(a, b, **kwargs):
    assert jtu.tree_structure(a) == jtu.tree_structure(b), (a, b)
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        np.testing.assert_allclose(np.asarray(x), np.asarray(y), **kwargs)


def scanned_identity(x, repeats=1):
    """Loop over an object with scan and return it (from the original thread)."""
    out, _ = lax.scan(lambda carry, x: (carry, ()), x, jnp.arange(repeats))
    return out


# ---------------------------------------------------------------------------------------
# The thread's example, as written there (with `jax.numpy as np` and our `grad`)


@differentiable
@dataclass
class Model:
    a: int
    b: differentiable
    c: differentiable
    d: str = "value"


def thread_loss(model):
    return 3 * jnp.sum(model.b) + 5 * jnp.sum(model.c)


def thread_model():
    return Model(a=1, b=jnp.ones((1,)), c=jnp.ones((2,)))


def test_thread_example_grad():
    dmodel = qt.grad(thread_loss)(thread_model())
    assert type(dmodel) is Model.Tangent
    assert type(dmodel).__name__ == "ModelTangent"
    assert [f.name for f in dataclasses.fields(Model.Tangent)] == ["b", "c"]
    assert_trees_close(
        dmodel, Model.Tangent(b=jnp.array([3.0]), c=jnp.array([5.0, 5.0]))
    )
    assert repr(dmodel) == (
        "ModelTangent(b=Array([3.], dtype=float32), c=Array([5., 5.], dtype=float32))"
    )


def test_thread_scanned_identity():
    assert scanned_identity({"a": 1, "b": 2}) == {"a": 1, "b": 2}
    model = thread_model()
    out = scanned_identity(model, repeats=3)
    assert type(out) is Model
    assert (out.a, out.d) == (1, "value")
    assert_trees_close(out, model)


def test_value_and_grad_and_jvp_take_the_tangent():
    model = thread_model()
    value, grads = qt.value_and_grad(thread_loss)(model)
    assert value == 13.0 and type(grads) is Model.Tangent
    tangent = Model.Tangent(b=jnp.array([1.0]), c=jnp.array([1.0, -2.0]))
    out, tangent_out = qt.jvp(thread_loss, (model,), (tangent,))
    assert out == 13.0 and tangent_out == 3.0 - 5.0


def test_numpy_fields():
    # The thread builds its model from NumPy float64 arrays.
    model = Model(a=1, b=np.ones((1,)), c=np.ones((2,)))
    grads = qt.grad(thread_loss)(model)
    assert_trees_close(grads, Model.Tangent(b=np.array([3.0]), c=np.array([5.0, 5.0])))
    moved = model.move(grads)
    assert moved.b.dtype == jnp.float32 and float(moved.b[0]) == 4.0


# ---------------------------------------------------------------------------------------
# Field kinds, in the three class forms


def _all_kinds_dataclass():
    @differentiable
    @dataclass
    class Layer:
        w: Differentiable[jax.Array]
        b: Annotated[jax.Array, Differentiable]
        stats: NoDerivative[jax.Array]
        step: int
        name: Static[str]
        width: Static[int] = 3

    return Layer


def _all_kinds_plain():
    @differentiable
    class Layer:
        w: Differentiable[jax.Array]
        b: Annotated[jax.Array, Differentiable]
        stats: NoDerivative[jax.Array]
        step: int
        name: Static[str]
        width: Static[int] = 3

    return Layer


def _all_kinds_module():
    @differentiable
    class Layer(eqx.Module):
        w: Differentiable[jax.Array]
        b: Annotated[jax.Array, Differentiable]
        stats: NoDerivative[jax.Array]
        step: int
        name: str = eqx.field(static=True)
        width: int = eqx.field(static=True, default=3)

    return Layer


FORMS = [_all_kinds_dataclass, _all_kinds_plain, _all_kinds_module]


def _layer(cls):
    return cls(
        w=jnp.ones((2, 3)), b=jnp.zeros(3), stats=jnp.ones(3), step=7, name="layer"
    )


def _layer_loss(layer):
    # Uses the data fields too: they must still get no tangent.
    return jnp.sum(layer.w * 2.0) + jnp.sum(layer.b) + jnp.sum(layer.stats) * layer.step


def _with_step(layer, step):
    return eqx.tree_at(lambda m: m.step, layer, step)


@pytest.mark.parametrize("make", FORMS)
def test_field_kinds(make):
    cls = make()
    layer = _layer(cls)
    leaves, treedef = jtu.tree_flatten(layer)
    # Differentiable and data fields are children; static ones are not.
    assert len(leaves) == 4 and "layer" not in leaves
    assert [f.name for f in dataclasses.fields(cls.Tangent)] == ["w", "b"]
    paths = [jtu.keystr(path) for path, _ in jtu.tree_flatten_with_path(layer)[0]]
    assert paths == [".w", ".b", ".stats", ".step"]
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is cls and (rebuilt.name, rebuilt.width) == ("layer", 3)

    grads = qt.grad(_layer_loss)(layer)
    assert type(grads) is cls.Tangent
    assert_trees_close(grads, cls.Tangent(w=2 * jnp.ones((2, 3)), b=jnp.ones(3)))
    moved = layer.move(-0.5 * grads)
    assert type(moved) is cls
    assert moved.stats is layer.stats and moved.step == 7 and moved.name == "layer"
    assert_trees_close(moved.w, jnp.zeros((2, 3)))


@pytest.mark.parametrize("make", FORMS)
def test_jit_vmap_cond_while_checkpoint(make):
    cls = make()
    layer = _layer(cls)
    grads = qt.grad(_layer_loss)(layer)

    @jax.jit
    def step(layer):
        g = qt.grad(_layer_loss)(layer)
        return _with_step(layer.move(-0.1 * g), layer.step + 1)

    stepped = step(layer)
    assert type(stepped) is cls and int(stepped.step) == 8
    assert_trees_close(stepped.w, layer.w - 0.2)

    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), layer, stepped)
    batched = jax.vmap(qt.grad(_layer_loss))(stacked)
    in_axes = jax.tree.map(lambda _: 0, stacked)  # a prefix tree of axis numbers
    assert_trees_close(
        jax.vmap(_layer_loss, (in_axes,))(stacked), jax.vmap(_layer_loss)(stacked)
    )
    assert type(batched) is cls.Tangent and batched.w.shape == (2, 2, 3)
    assert_trees_close(jax.vmap(_layer_loss)(stacked)[0], _layer_loss(layer), rtol=1e-6)

    chosen = lax.cond(True, lambda m: m.move(grads), lambda m: m, layer)
    assert type(chosen) is cls
    assert_trees_close(chosen.w, layer.w + 2)

    def body(carry):
        return _with_step(carry.move(0.5 * grads), carry.step + 1)

    looped = lax.while_loop(lambda m: m.step < 10, body, layer)
    assert type(looped) is cls and int(looped.step) == 10
    assert_trees_close(looped.b, layer.b + 1.5)

    checkpointed = qt.grad(jax.checkpoint(_layer_loss))(layer)
    assert_trees_close(checkpointed, grads)

    doubled = jax.tree.map(lambda x: 2 * x, layer)
    assert type(doubled) is cls and doubled.name == "layer" and doubled.step == 14


@pytest.mark.parametrize("make", FORMS)
def test_serialise_leaves(make, tmp_path):
    cls = make()
    layer = _layer(cls)
    eqx.tree_serialise_leaves(tmp_path / "layer.eqx", layer)
    like = jax.tree.map(jnp.zeros_like, layer)
    loaded = eqx.tree_deserialise_leaves(tmp_path / "layer.eqx", like)
    assert type(loaded) is cls and loaded.name == "layer"
    assert_trees_close(loaded, layer)


# Module level, so that pickle can find them.
@differentiable
@dataclass(frozen=True)
class PickledInner:
    w: Differentiable[jax.Array]
    label: str = "inner"


@differentiable
class PickledOuter(eqx.Module):
    inner: PickledInner
    scale: Differentiable[jax.Array]
    count: jax.Array


def test_pickle():
    model = PickledOuter(PickledInner(jnp.arange(3.0)), jnp.ones(()), jnp.array(2))
    loaded = pickle.loads(pickle.dumps(model))
    assert type(loaded) is PickledOuter and type(loaded.inner) is PickledInner
    assert_trees_close(loaded, model)
    grads = qt.grad(lambda m: jnp.sum(m.inner.w) * m.scale)(model)
    assert type(grads.inner) is PickledInner.Tangent
    loaded_grads = pickle.loads(pickle.dumps(grads))
    assert type(loaded_grads) is PickledOuter.Tangent
    assert_trees_close(loaded_grads, grads)
    assert PickledOuter.Tangent.__qualname__ == "PickledOuter.Tangent"


# ---------------------------------------------------------------------------------------
# The rule for fields without a marker


class Colour(enum.Enum):
    RED = 1


@differentiable
@dataclass
class Unmarked:
    step: int
    rate: float
    stats: jax.Array
    anything: Any
    weights: list[jax.Array]
    shape: tuple[int, ...]
    name: str
    training: bool
    mode: Literal["a", "b"]
    activation: Callable
    colour: Colour
    names: tuple[str, ...]
    maybe: str | None
    fixed_shape: Static[tuple[int, ...]]


def test_unmarked_fields_rule():
    model = Unmarked(
        step=1,
        rate=0.5,
        stats=jnp.ones(2),
        anything=jnp.zeros(1),
        weights=[jnp.ones(1)],
        shape=(2, 3),
        name="n",
        training=True,
        mode="a",
        activation=jnp.tanh,
        colour=Colour.RED,
        names=("x", "y"),
        maybe=None,
        fixed_shape=(4,),
    )
    kinds = dict(Unmarked.__qt_spec__.fields)
    data = ["step", "rate", "stats", "anything", "weights", "shape"]
    static = ["name", "training", "mode", "activation", "colour", "names", "maybe"]
    assert [k for k in kinds if kinds[k] == "data"] == data
    assert [k for k in kinds if kinds[k] == "static"] == [*static, "fixed_shape"]
    assert dataclasses.fields(Unmarked.Tangent) == ()

    # Static fields are Python values under jit; data fields are traced.
    def fn(m):
        assert isinstance(m.step, jax.core.Tracer) and isinstance(
            m.rate, jax.core.Tracer
        )
        return jnp.zeros(m.fixed_shape) + m.step if m.training else None

    assert_trees_close(jax.jit(fn)(model), jnp.ones(4))


def test_module_fields_follow_equinox():
    @differentiable
    class Net(eqx.Module):
        w: Differentiable[jax.Array]
        name: str  # in a Module, unmarked is data, as equinox makes it a child
        size: int = eqx.field(static=True, default=2)

    net = Net(jnp.ones(2), "net")
    assert "net" in jtu.tree_leaves(net)
    assert dict(Net.__qt_spec__.fields) == {
        "w": "differentiable",
        "name": "data",
        "size": "static",
    }


# ---------------------------------------------------------------------------------------
# The Tangent's operations


@differentiable
@dataclass
class Pair:
    x: Differentiable[jax.Array]
    y: Differentiable[jax.Array]


@differentiable
@dataclass
class Nested:
    pair: Pair
    pairs: list[Pair]
    z: Differentiable[jax.Array]
    counter: int = 0


def _nested_tangent(seed):
    rng = np.random.default_rng(seed)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    return Nested.Tangent(
        pair=Pair.Tangent(normal(2), normal(3)),
        pairs=[Pair.Tangent(normal(1), normal(2))],
        z=normal(2, 2),
    )


def test_tangent_arithmetic():
    t, u = _nested_tangent(0), _nested_tangent(1)
    assert type((t + u).pair) is Pair.Tangent
    assert_trees_close(t + u, jax.tree.map(jnp.add, t, u))
    assert_trees_close(t - u, jax.tree.map(jnp.subtract, t, u))
    assert_trees_close(-t, jax.tree.map(jnp.negative, t))
    assert_trees_close(2.0 * t, jax.tree.map(lambda x: 2 * x, t))
    assert_trees_close(t * jnp.float32(3), jax.tree.map(lambda x: 3 * x, t))
    assert_trees_close(t / 4.0, jax.tree.map(lambda x: x / 4, t))
    assert_trees_close(sum([t, u, t]), t + u + t)
    flat = lambda a: jnp.concatenate([jnp.ravel(x) for x in jtu.tree_leaves(a)])
    np.testing.assert_allclose(qt.inner(t, u), jnp.dot(flat(t), flat(u)), rtol=1e-6)
    np.testing.assert_allclose(qt.norm(t), jnp.linalg.norm(flat(t)), rtol=1e-6)
    # Scalars may be traced.
    scaled = jax.jit(lambda s, t: s * t)(jnp.float32(2), t)
    assert_trees_close(scaled, 2 * t)


def test_tangent_arithmetic_errors():
    t = _nested_tangent(0)
    with pytest.raises(TypeError, match="needs a scalar"):
        t * t
    with pytest.raises(TypeError, match="needs a scalar"):
        t * jnp.ones(2)
    with pytest.raises(TypeError, match=r"needs `x` to be a `NestedTangent` too"):
        t + Pair.Tangent(jnp.ones(2), jnp.ones(3))
    with pytest.raises(TypeError, match="two tangents of one class"):
        qt.inner(t, Pair.Tangent(jnp.ones(2), jnp.ones(3)))


def test_zero_tangent_and_dtypes():
    model = Nested(
        pair=Pair(jnp.ones(2, jnp.bfloat16), jnp.ones(3)),
        pairs=[Pair(jnp.ones(1), jnp.ones(2))],
        z=jnp.ones((2, 2)),
    )
    zero = qt.zero_tangent(model)
    assert type(zero) is Nested.Tangent and type(zero.pairs[0]) is Pair.Tangent
    assert zero.pair.x.dtype == jnp.bfloat16
    assert all(not jnp.any(x) for x in jtu.tree_leaves(zero))
    assert_trees_close(model.move(zero), model)
    # A moved field keeps its dtype (`optax.apply_updates` semantics), so a moved
    # model is a valid scan carry.
    moved = model.move(_nested_tangent(2))
    assert moved.pair.x.dtype == jnp.bfloat16
    carried, _ = lax.scan(lambda m, _: (m.move(0.1 * zero), None), model, None, 3)
    assert type(carried) is Nested


def test_inner_of_compressed_leaves():
    rng = np.random.default_rng(3)
    normal = lambda *shape: jnp.asarray(rng.standard_normal(shape), jnp.float32)
    a = qt.LowRank(normal(2, 5, 2), normal(2, 4, 2))
    b = qt.LowRank(normal(2, 5, 3), normal(2, 4, 3))
    d = normal(2, 5, 4)
    dense = lambda x: x.materialise() if isinstance(x, qt.LowRank) else x
    # Low-rank leaves pair through their factors, batch dims included: no fallback.
    with qt.fallback("error"):
        for x, y in [(a, b), (a, d), (d, a), (a, a)]:
            np.testing.assert_allclose(
                qt.inner(x, y), jnp.sum(dense(x) * dense(y)), rtol=1e-5, atol=1e-5
            )
    # A type without its own product goes through the rules, counted.
    q = qt.quantize(d)
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        np.testing.assert_allclose(
            qt.inner(q, d), jnp.sum(q.materialise() * d), rtol=1e-5
        )
        np.testing.assert_allclose(
            qt.inner(d, q), jnp.sum(q.materialise() * d), rtol=1e-5
        )
    assert sum(qt.fallback_counts().values()) >= 2


def test_tangent_with_compressed_fields():
    matrix = qt.low_rank(jnp.outer(jnp.arange(8.0), jnp.ones(6)), rank=1)
    other = qt.low_rank(jnp.outer(jnp.ones(8), jnp.arange(6.0)), rank=1)
    t = Pair.Tangent(x=matrix, y=jnp.ones(3))
    u = Pair.Tangent(x=other, y=jnp.arange(3.0))
    assert type((t + u).x) is qt.LowRank and (t + u).x.rank == 2
    assert type((-0.5 * t).x) is qt.LowRank and type((t / 2).x) is qt.LowRank
    dense_t, dense_u = qt.materialise(t), qt.materialise(u)
    np.testing.assert_allclose(qt.inner(t, u), qt.inner(dense_t, dense_u), rtol=1e-5)
    np.testing.assert_allclose(
        qt.inner(t, dense_u), qt.inner(dense_t, dense_u), rtol=1e-5
    )
    np.testing.assert_allclose(
        qt.inner(dense_t, u), qt.inner(dense_t, dense_u), rtol=1e-5
    )
    np.testing.assert_allclose(qt.norm(t), qt.norm(dense_t), rtol=1e-5)
    assert_trees_close(
        qt.materialise((t - u) / 2), (dense_t - dense_u) / 2, rtol=1e-5, atol=1e-6
    )

    model = Pair(x=jnp.zeros((8, 6)), y=jnp.zeros(3))
    moved = model.move(t)
    assert type(moved.x) is not qt.LowRank
    assert_trees_close(moved, Pair(dense_t.x, dense_t.y))


def test_grad_gives_compressed_fields_and_jvp_takes_them():
    model = Pair(x=jnp.ones((8, 6)), y=jnp.ones(3))
    data = jnp.asarray(np.random.default_rng(0).standard_normal((4, 8)), jnp.float32)

    def loss(pair):
        w = qt.compress_cotangent(pair.x, ft.partial(qt.low_rank, rank=2))
        return jnp.sum(jnp.tanh(data @ w)) + jnp.sum(pair.y**2)

    grads = qt.grad(loss)(model)
    assert type(grads) is Pair.Tangent and type(grads.x) is qt.LowRank
    dense = jax.grad(loss)(model)
    np.testing.assert_allclose(qt.materialise(grads.x), dense.x, rtol=1e-4, atol=1e-5)

    direction = Pair.Tangent(x=qt.low_rank(jnp.ones((8, 6)), rank=1), y=jnp.zeros(3))
    _, out = qt.jvp(ft.partial(lambda d, p: d @ p.x, data), (model,), (direction,))
    assert type(out) is qt.LowRank
    np.testing.assert_allclose(qt.materialise(out), data @ jnp.ones((8, 6)), rtol=1e-5)


# ---------------------------------------------------------------------------------------
# move


def test_move_keeps_everything_else():
    model = Nested(
        Pair(jnp.ones(2), jnp.ones(3)),
        [Pair(jnp.ones(1), jnp.ones(2))],
        jnp.ones((2, 2)),
        counter=5,
    )
    t = _nested_tangent(3)
    moved = qt.move(model, t)
    assert type(moved) is Nested and type(moved.pairs[0]) is Pair
    assert moved.counter == 5
    assert_trees_close(moved.pair.x, model.pair.x + t.pair.x)
    # `None` entries leave their fields alone, as in `optax.apply_updates`.
    partial = dataclasses.replace(t, z=None)
    assert qt.move(model, partial).z is model.z
    assert_trees_close(model.move(t).move(t), model.move(t + t), rtol=1e-6)


def test_apply_updates_with_optax():
    optax = pytest.importorskip("optax")
    import quax_tangents.optax as qto

    model = Nested(
        Pair(jnp.ones(2), jnp.ones(3)),
        [Pair(jnp.ones(1), jnp.ones(2))],
        jnp.ones((2, 2)),
    )

    def loss(m):
        return sum(jnp.sum(x**2) for x in jtu.tree_leaves(qt.differentiable_part(m)))

    optimizer = optax.adamw(0.1, weight_decay=0.01)
    state = optimizer.init(qt.differentiable_part(model))
    for _ in range(3):
        grads = qt.grad(loss)(model)
        params = qt.differentiable_part(model)
        updates, state = optimizer.update(grads, state, params)
        assert type(updates) is Nested.Tangent
        expected = optax.apply_updates(params, updates)
        model = qto.apply_updates(model, updates)
        assert_trees_close(qt.differentiable_part(model), expected)
    assert type(model) is Nested and model.counter == 0
    assert loss(model) < 9.0


# ---------------------------------------------------------------------------------------
# What plain `jax.grad` returns


@differentiable
@dataclass
class WithStats:
    w: Differentiable[jax.Array]
    stats: jax.Array  # float data
    step: int = 0
    name: str = "m"


def _stats_loss(m):
    return jnp.sum(m.w * m.stats)


def test_plain_jax_grad_sees_an_ordinary_pytree():
    model = WithStats(w=jnp.ones(2), stats=jnp.array([2.0, 3.0]), step=0)
    # jax.grad differentiates every dynamic leaf, so integer data is refused...
    with pytest.raises(TypeError, match="grad requires real- or complex-valued"):
        jax.grad(_stats_loss)(model)
    # ...and with allow_int it returns a `WithStats` (not a Tangent), with a gradient
    # for the non-differentiable data too and float0 zeros for the integers.
    plain = jax.grad(_stats_loss, allow_int=True)(model)
    assert type(plain) is WithStats and plain.name == "m"
    assert_trees_close(plain.w, jnp.array([2.0, 3.0]))
    assert_trees_close(plain.stats, jnp.ones(2))
    assert plain.step.dtype == jax.dtypes.float0
    ours = qt.grad(_stats_loss)(model)
    assert type(ours) is WithStats.Tangent
    assert [f.name for f in dataclasses.fields(ours)] == ["w"]


# ---------------------------------------------------------------------------------------
# A user-declared Tangent of another structure (the first seed thread: a primal buffer
# whose tangent is a smaller representation)


class BufferTangent(NamedTuple):
    """Two numbers for a whole buffer: a common shift and a log-scale."""

    shift: jax.Array
    log_scale: jax.Array

    def __add__(self, other):
        return BufferTangent(self.shift + other.shift, self.log_scale + other.log_scale)

    @staticmethod
    def zero(buffer):
        return BufferTangent(jnp.zeros(()), jnp.zeros(()))


@differentiable(tangent=BufferTangent)
@dataclass
class Buffer:
    values: Differentiable[jax.Array]
    head: int = 0

    def move(self, tangent):
        moved = self.values * jnp.exp(tangent.log_scale) + tangent.shift
        return dataclasses.replace(self, values=moved)


def _buffer_loss(buffer):
    return jnp.sum(buffer.values**2)


def test_user_declared_tangent_grad_and_jvp():
    buffer = Buffer(jnp.array([1.0, 2.0, 3.0]), head=1)
    assert Buffer.Tangent is BufferTangent
    grads = qt.grad(_buffer_loss)(buffer)
    assert type(grads) is BufferTangent
    # d/dshift = sum(2v); d/dlog_scale = sum(2v * v)
    assert_trees_close(grads, BufferTangent(jnp.array(12.0), jnp.array(28.0)))
    out, tangent_out = qt.jvp(
        _buffer_loss, (buffer,), (BufferTangent(jnp.array(1.0), jnp.array(0.5)),)
    )
    assert out == 14.0 and tangent_out == 12.0 + 0.5 * 28.0
    assert_trees_close(qt.zero_tangent(buffer), BufferTangent(0.0, 0.0))
    moved = qt.move(buffer, grads + grads)
    assert type(moved) is Buffer and moved.head == 1
    with pytest.raises(TypeError, match="no differentiable part"):
        qt.differentiable_part(buffer)


@differentiable
@dataclass
class HoldsBuffer:
    buffer: Buffer
    bias: Differentiable[jax.Array]


def test_user_declared_tangent_nested():
    model = HoldsBuffer(Buffer(jnp.array([1.0, 2.0, 3.0])), jnp.ones(()))
    loss = lambda m: _buffer_loss(m.buffer) * m.bias
    grads = qt.grad(loss)(model)
    assert type(grads) is HoldsBuffer.Tangent and type(grads.buffer) is BufferTangent
    assert_trees_close(grads.buffer, BufferTangent(jnp.array(12.0), jnp.array(28.0)))
    assert_trees_close((grads + grads).buffer, BufferTangent(24.0, 56.0))
    # The user's Tangent defines `+` only; a NamedTuple's `*` would repeat it.
    with pytest.raises(TypeError, match="does not define `__mul__`"):
        2 * grads
    moved = model.move(qt.zero_tangent(model))
    assert_trees_close(moved, model)
    assert type(scanned_identity(model)) is HoldsBuffer


def test_user_declared_tangent_protocol_errors():
    class NoZero(NamedTuple):
        s: jax.Array

        def __add__(self, other):
            return NoZero(self.s + other.s)

    class Concatenates(NamedTuple):
        s: jax.Array

        @staticmethod
        def zero(model):
            return Concatenates(jnp.zeros(()))

    with pytest.raises(TypeError, match=r"NoZero.zero\(model\)"):

        @differentiable(tangent=NoZero)
        @dataclass
        class A:
            x: Differentiable[jax.Array]

            def move(self, t):
                return self

    with pytest.raises(TypeError, match="concatenates"):

        @differentiable(tangent=Concatenates)
        @dataclass
        class B:
            x: Differentiable[jax.Array]

            def move(self, t):
                return self

    with pytest.raises(TypeError, match=r"C.move\(self, tangent\)"):

        @differentiable(tangent=BufferTangent)
        @dataclass
        class C:
            x: Differentiable[jax.Array]


# ---------------------------------------------------------------------------------------
# Bad input


def test_move_with_the_wrong_tangent_class():
    with pytest.raises(TypeError, match=r"needs a `Model.Tangent` \(`ModelTangent`\)"):
        thread_model().move(Pair.Tangent(jnp.ones(1), jnp.ones(2)))
    with pytest.raises(TypeError, match="got Model"):
        qt.move(thread_model(), thread_model())
    with pytest.raises(TypeError, match="must be an instance of a"):
        qt.move({"b": 1.0}, None)
    with pytest.raises(ValueError, match="tangent has shape"):
        thread_model().move(Model.Tangent(b=jnp.ones(1), c=jnp.ones(3)))


def test_tangent_missing_or_extra_fields():
    with pytest.raises(
        TypeError,
        match=r"exactly the differentiable fields of `Model`, \['b', 'c'\].*missing",
    ):
        Model.Tangent(b=jnp.ones(1))
    with pytest.raises(TypeError, match="unexpected keyword argument 'a'"):
        Model.Tangent(b=jnp.ones(1), c=jnp.ones(2), a=1)
    assert type(Model.Tangent(jnp.ones(1), jnp.ones(2))) is Model.Tangent

    @differentiable
    class Plain:
        x: Differentiable[jax.Array]
        n: int = 0

    with pytest.raises(
        TypeError, match=r"`.*Plain` takes the fields \['x', 'n'\].*missing"
    ):
        Plain()
    with pytest.raises(TypeError, match="unexpected keyword argument 'y'"):
        Plain(x=jnp.ones(1), y=2)


@pytest.mark.parametrize("make", FORMS)
def test_unhashable_static_field(make):
    cls = make()
    with pytest.raises(
        TypeError, match=r"Static field `.*Layer.name` holds an unhashable list"
    ):
        cls(w=jnp.ones(2), b=jnp.ones(2), stats=jnp.ones(2), step=0, name=["a"])


@pytest.mark.parametrize("make", FORMS)
def test_differentiable_field_holding_integers(make):
    cls = make()
    with pytest.raises(
        TypeError, match=r"`.*Layer.w` is differentiable but holds a dtype int32"
    ):
        cls(w=jnp.arange(3), b=jnp.ones(2), stats=jnp.ones(2), step=0, name="a")
    with pytest.raises(
        TypeError, match=r"`.*Layer.b` is differentiable but holds a dtype int32"
    ):
        cls(w=jnp.ones(2), b=1, stats=jnp.ones(2), step=0, name="a")


def test_differentiable_field_mutated_to_integers():
    model = thread_model()
    model.b = jnp.arange(1)  # a non-frozen dataclass can be changed after the checks
    with pytest.raises(
        TypeError, match="`Model.b` is differentiable but holds a dtype int32"
    ):
        qt.grad(thread_loss)(model)


def test_decorator_applied_twice():
    with pytest.raises(
        TypeError, match="already @differentiable; apply the decorator once"
    ):
        differentiable(Model)


def test_field_both_static_and_differentiable():
    with pytest.raises(TypeError, match="marked both Differentiable and Static"):

        @differentiable
        @dataclass
        class A:
            x: Annotated[jax.Array, Differentiable, Static]

    with pytest.raises(TypeError, match="marked both Differentiable and Static"):

        @differentiable
        @dataclass
        class B:
            x: Differentiable[jax.Array] = dataclasses.field(metadata={"static": True})

    with pytest.raises(TypeError, match="marked both Differentiable and Static"):

        @differentiable
        class C(eqx.Module):
            x: Differentiable[jax.Array] = eqx.field(static=True)

    with pytest.raises(TypeError, match="marked both Static and NoDerivative"):

        @differentiable
        @dataclass
        class D:
            x: Static[NoDerivative[int]]

    with pytest.raises(
        TypeError, match=r"equinox decides what is static.*eqx|equinox.field"
    ):

        @differentiable
        class E(eqx.Module):
            x: Static[str]


def test_other_declaration_errors():
    with pytest.raises(TypeError, match="defines `move` itself"):

        @differentiable
        @dataclass
        class A:
            x: Differentiable[jax.Array]

            def move(self, t):
                return self

    with pytest.raises(TypeError, match="field named `move`"):

        @differentiable
        @dataclass
        class B:
            move: Differentiable[jax.Array]

    @jtu.register_dataclass
    @dataclass
    class Registered:
        x: jax.Array

    with pytest.raises(TypeError, match="already registered as a pytree"):
        differentiable(Registered)

    with pytest.raises(TypeError, match="is a field annotation, not a value"):
        Differentiable()


def test_undecorated_subclass_and_extra_attributes():
    @differentiable
    class Base:
        x: Differentiable[jax.Array]

        def __init__(self, x):
            self.x = x

    class Sub(Base):
        pass

    with pytest.raises(TypeError, match="subclasses the @differentiable class"):
        Sub(jnp.ones(1))

    @differentiable
    class Cached:
        x: Differentiable[jax.Array]

        def __init__(self, x):
            self.x = x
            self.cache = {}

    with pytest.raises(
        TypeError, match=r"attributes \['cache'\] that are not declared"
    ):
        Cached(jnp.ones(1))

    @differentiable
    @dataclass
    class Named:
        x: Differentiable[jax.Array]
        label: Any = None

    with pytest.raises(TypeError, match="annotate it `Static"):
        Named(jnp.ones(1), label="a")


def test_slots_dataclass():
    @differentiable
    @dataclass(slots=True, frozen=True)
    class Slotted:
        w: Differentiable[jax.Array]
        step: int = 0
        name: str = "s"

    model = Slotted(jnp.ones(2), 3)
    grads = qt.grad(lambda m: jnp.sum(m.w) * m.step)(model)
    assert_trees_close(grads, Slotted.Tangent(3 * jnp.ones(2)))
    moved = model.move(grads)
    assert (moved.step, moved.name) == (3, "s")
    assert type(scanned_identity(moved)) is Slotted


def test_decorated_subclass():
    @differentiable
    @dataclass
    class Base:
        x: Differentiable[jax.Array]

    @differentiable
    @dataclass
    class Sub(Base):
        y: Differentiable[jax.Array]
        tag: str = "sub"

    sub = Sub(jnp.ones(1), jnp.ones(2))
    grads = qt.grad(lambda m: jnp.sum(m.x) + 2 * jnp.sum(m.y))(sub)
    assert type(grads) is Sub.Tangent
    assert_trees_close(grads, Sub.Tangent(jnp.ones(1), 2 * jnp.ones(2)))
    assert type(scanned_identity(sub)) is Sub


# ---------------------------------------------------------------------------------------
# Property tests over generated classes: random field kinds, forms and nesting


SHAPES = [(), (2,), (2, 3)]


@dataclasses.dataclass(frozen=True)
class FieldSpec:
    kind: str  # "diff", "data_float", "data_int", "static", "nested"
    style: int  # which way of writing the annotation
    shape: tuple[int, ...] = ()
    inner: "ClassSpec | None" = None


@dataclasses.dataclass(frozen=True)
class ClassSpec:
    form: str
    fields: tuple[FieldSpec, ...]


def class_specs(depth=0):
    kinds = ["diff", "data_float", "data_int", "static"] + (
        ["nested"] if depth < 2 else []
    )
    field = st.builds(
        FieldSpec,
        kind=st.sampled_from(kinds),
        style=st.integers(0, 2),
        shape=st.sampled_from(SHAPES),
    ).flatmap(
        lambda f: (
            st.builds(
                lambda inner: dataclasses.replace(f, inner=inner),
                class_specs(depth + 1),
            )
            if f.kind == "nested"
            else st.just(f)
        )
    )
    return st.builds(
        ClassSpec,
        form=st.sampled_from(["dataclass", "plain", "module"]),
        fields=st.lists(field, min_size=1, max_size=4).map(tuple),
    )


def _annotation(spec: FieldSpec, form: str):
    if spec.kind == "diff":
        return [
            Differentiable,
            Differentiable[jax.Array],
            Annotated[jax.Array, Differentiable],
        ][spec.style]
    if spec.kind == "data_float":
        return [jax.Array, NoDerivative[jax.Array], Any][spec.style]
    if spec.kind == "data_int":
        return [int, NoDerivative[int], jax.Array][spec.style]
    if spec.kind == "static":
        if form == "module":
            return [str, int, tuple[int, ...]][spec.style]
        return [str, Static[int], Static[tuple[int, ...]]][spec.style]
    return build_class(spec.inner)


def build_class(spec: ClassSpec):
    annotations = {
        f"f{i}": _annotation(f, spec.form) for i, f in enumerate(spec.fields)
    }
    namespace: dict[str, Any] = {"__annotations__": annotations}
    if spec.form == "module":
        for i, f in enumerate(spec.fields):
            if f.kind == "static":
                namespace[f"f{i}"] = eqx.field(static=True)
        cls = type("Generated", (eqx.Module,), namespace)
    else:
        cls = type("Generated", (), namespace)
        if spec.form == "dataclass":
            cls = dataclass(cls)
    return differentiable(cls)


def build_instance(spec: ClassSpec, cls, rng):
    values = {}
    for i, f in enumerate(spec.fields):
        if f.kind in ("diff", "data_float"):
            value = jnp.asarray(rng.standard_normal(f.shape), jnp.float32)
        elif f.kind == "data_int":
            value = int(rng.integers(10)) if f.style < 2 else jnp.arange(2)
        elif f.kind == "static":
            value = ["name", 3, (1, 2)][f.style]
        else:
            inner_cls = cls.__annotations__[f"f{i}"]
            value = build_instance(f.inner, inner_cls, rng)
        values[f"f{i}"] = value
    return cls(**values)


@st.composite
def models(draw):
    spec = draw(class_specs())
    cls = build_class(spec)
    rng = np.random.default_rng(draw(st.integers(0, 2**16)))
    return cls, build_instance(spec, cls, rng), rng


def _float_leaves_loss(model):
    """A loss that touches every floating leaf, data included, with its own weight."""
    leaves = [
        x
        for x in jtu.tree_leaves(model)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    return sum(
        ((i + 1) * jnp.sum(x) for i, x in enumerate(leaves)), start=jnp.float32(0)
    )


def _expected_grad(model):
    weights = {}
    leaves = [
        x
        for x in jtu.tree_leaves(model)
        if jnp.issubdtype(jnp.result_type(x), jnp.floating)
    ]
    for i, x in enumerate(leaves):
        weights[id(x)] = i + 1
    return jax.tree.map(
        lambda p: weights[id(p)] * jnp.ones_like(p), qt.differentiable_part(model)
    )


def _random_tangent(model, rng):
    return jax.tree.map(
        lambda p: jnp.asarray(rng.standard_normal(jnp.shape(p)), jnp.float32),
        qt.differentiable_part(model),
    )


def _assert_same_model(a, b):
    assert jtu.tree_structure(a) == jtu.tree_structure(b)  # classes and static fields
    for x, y in zip(jtu.tree_leaves(a), jtu.tree_leaves(b)):
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


@given(models())
def test_property_round_trips(generated):
    cls, model, _ = generated
    leaves, treedef = jtu.tree_flatten(model)
    rebuilt = jtu.tree_unflatten(treedef, leaves)
    assert type(rebuilt) is cls
    _assert_same_model(rebuilt, model)
    _assert_same_model(scanned_identity(model, repeats=2), model)
    _assert_same_model(jax.jit(lambda m: m)(model), model)


@given(models())
def test_property_grad(generated):
    cls, model, rng = generated
    grads = qt.grad(_float_leaves_loss)(model)
    assert type(grads) is cls.Tangent
    expected = _expected_grad(model)
    assert jtu.tree_structure(grads) == jtu.tree_structure(expected)
    assert_trees_close(grads, expected)
    direction = _random_tangent(model, rng)
    _, tangent_out = qt.jvp(_float_leaves_loss, (model,), (direction,))
    np.testing.assert_allclose(
        tangent_out, qt.inner(expected, direction), rtol=1e-5, atol=1e-5
    )


@given(models())
def test_property_move(generated):
    cls, model, rng = generated
    t, u = _random_tangent(model, rng), _random_tangent(model, rng)
    _assert_same_model(model.move(qt.zero_tangent(model)), model)
    moved = model.move(t)
    assert type(moved) is cls
    # Everything that is not differentiable is carried over untouched.
    is_diff = lambda m: set(map(id, jtu.tree_leaves(qt.differentiable_part(m))))
    diff_ids = is_diff(model)
    kept = [x for x in jtu.tree_leaves(model) if id(x) not in diff_ids]
    moved_diff_ids = is_diff(moved)
    moved_kept = [x for x in jtu.tree_leaves(moved) if id(x) not in moved_diff_ids]
    assert len(moved_kept) == len(kept)
    assert all(x is y for x, y in zip(moved_kept, kept))
    assert_trees_close(qt.differentiable_part(moved), qt.differentiable_part(model) + t)
    assert_trees_close(moved.move(u), model.move(t + u), rtol=1e-5, atol=1e-6)
    assert_trees_close(moved.move(-t), model, rtol=1e-5, atol=1e-6)


def test_vjp_and_linearize_use_the_tangent_type():
    @qt.differentiable
    @dataclasses.dataclass
    class Affine:
        w: qt.Differentiable
        steps: int = 0

    model = Affine(w=jnp.arange(3.0), steps=2)
    out, pullback = qt.vjp(lambda m: jnp.sum(m.w**2) * m.steps, model)
    (ct,) = pullback(jnp.ones(()))
    assert isinstance(ct, Affine.Tangent)
    assert jnp.allclose(ct.w, 4 * jnp.arange(3.0))
    _, f_jvp = qt.linearize(lambda m: jnp.sum(m.w**2) * m.steps, model)
    assert jnp.allclose(
        f_jvp(Affine.Tangent(w=jnp.ones(3))), 4 * jnp.sum(jnp.arange(3.0))
    )
