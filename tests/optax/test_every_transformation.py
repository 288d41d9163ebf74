"""Every public optax transformation, handed a compressed gradient, gives the update
that `qto.lift` of the same transformation gives, or raises an error that names a
fix. Nothing in between: no wrong update without an error.

The transformations are found by walking `optax`'s and `optax.contrib`'s public names
(not a hand-written list), so a new optax release is checked as it comes. Each is
built with simple arguments chosen by parameter name; the few that cannot be built
or run generically are listed in `SKIPPED` with the reason.
"""

import functools as ft
import inspect

import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
import pytest

import quax_tangents as qt
import quax_tangents.optax as qto
from tests.helpers import assert_close


SHAPE = (8, 6)
LOSS = jnp.asarray(1.0)
TYPES = ("LowRank", "SparseRows", "Quantized", "SignNorm")

# What a clear error names: one of the fixes, which the guard leaf's dtype and the
# compressed classes' repr spell out in JAX's own errors.
FIXES = (
    "quax_tangents.optax.lift",
    "quax_tangents.optax.projected",
    "quax_tangents.optax.accumulate_gradients",
    "quax_tangents.optax.apply_updates",
    "quax_tangents.materialise",
)

SKIPPED = {
    # Line searches call the loss (`value_fn`) with the parameters moved along the
    # update: they need a loss function, which a gradient-only check has none of.
    "scale_by_backtracking_linesearch": "needs the loss function as an extra argument",
    "scale_by_zoom_linesearch": "needs the loss function as an extra argument",
    "hutchinson_estimator_diag_hessian": "needs the objective function",
    # Per-example gradients (a leading batch axis on every leaf) are not gradients of
    # one weight.
    "dpsgd": "takes per-example gradients",
    "differentially_private_aggregate": "takes per-example gradients",
    # Wrappers whose arguments carry behaviour a generic check cannot choose.
    "lookahead": "needs parameters wrapped in `LookaheadParams`",
    "snapshot": "needs a measure function",
    "measure_with_ema": "needs a measure function",
    "sam": "needs the adversarial step's gradients in a second call",
}


def _inner() -> optax.GradientTransformation:
    return optax.sgd(0.1)


def _labels(params):
    return jax.tree.map(lambda _: "a", params)


def _all_true(params):
    return jax.tree.map(lambda _: True, params)


# Arguments by parameter name: the simple value each required parameter gets.
ARGUMENTS = {
    "learning_rate": 0.1,
    "step_size": 0.1,
    "step_size_fn": lambda count: 0.1 / (1 + count),
    "max_delta": 0.5,
    "max_norm": 0.5,
    "clipping": 0.5,
    "threshold": 0.5,
    "decay": 0.9,
    "eta": 0.01,
    "gamma": 0.55,
    "max_consecutive_errors": 2,
    "every_k_schedule": 2,
    "inner": _inner,
    "opt": _inner,
    "tx": _inner,
    "optimizer": _inner,
    "base_optimizer": _inner,
    "fast_optimizer": _inner,
    "mask": _all_true,
    "freeze_mask": lambda params: jax.tree.map(lambda _: False, params),
    "should_transform_fn": lambda count: count >= 0,
    "transforms": lambda: {"a": _inner()},
    "param_labels": _labels,
    "f": lambda updates, params: jax.tree.map(lambda g: -0.1 * g, updates),
}


# Optional arguments whose defaults make a transformation the identity.
OVERRIDES = {
    "add_decayed_weights": dict(weight_decay=0.01),
    "scale_by_learning_rate": dict(learning_rate=0.1),
}


def _returns_transformation(obj) -> bool:
    annotation = inspect.signature(obj).return_annotation
    return "GradientTransformation" in str(getattr(annotation, "__name__", annotation))


def _buildable(obj) -> bool:
    """Whether an unannotated public function builds a transformation from the
    arguments here (optax leaves a few factories unannotated)."""
    required = [
        p.name
        for p in inspect.signature(obj).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if not all(name in ARGUMENTS for name in required):
        return False
    try:
        built = obj(**{name: _argument(name) for name in required})
    except Exception:  # noqa: BLE001
        return False
    return isinstance(built, optax.GradientTransformation)


def _public_factories() -> dict:
    """Every public transformation factory of `optax` and `optax.contrib`, by name:
    functions annotated to return a transformation, unannotated functions that
    build one, and `optax.MultiSteps`."""
    found = {}
    for module in (optax, optax.contrib):
        for name in sorted(dir(module)):
            obj = getattr(module, name)
            if name.startswith("_") or name in found:
                continue
            if obj is optax.MultiSteps:
                found[name] = obj
            elif inspect.isfunction(obj) and (
                _returns_transformation(obj)
                or (
                    inspect.signature(obj).return_annotation is inspect.Signature.empty
                    and _buildable(obj)
                )
            ):
                found[name] = obj
    return found


def _argument(name: str):
    argument = ARGUMENTS[name]
    # Fresh inner transformations for each wrapper.
    return argument() if argument is _inner or name == "transforms" else argument


FACTORIES = _public_factories()


def _build(name: str) -> optax.GradientTransformation:
    """The transformation `name`, with the arguments of `ARGUMENTS` by parameter
    name (a `KeyError` for a new required parameter: add it there)."""
    factory = FACTORIES[name]
    if name == "MultiSteps":
        return optax.MultiSteps(_inner(), every_k_schedule=2).gradient_transformation()
    if name in ("inject_hyperparams", "inject_stateful_hyperparams"):
        return factory(optax.sgd)(learning_rate=0.1)
    if name == "stateless_with_tree_map":
        return factory(lambda g, p: -0.1 * g)
    if name in OVERRIDES:
        return factory(**OVERRIDES[name])
    if name == "chain":
        return factory(optax.clip(0.5), _inner())
    if name == "named_chain":
        return factory(("clip", optax.clip(0.5)), ("sgd", _inner()))
    kwargs = {}
    for param in inspect.signature(factory).parameters.values():
        if param.default is not param.empty or param.kind in (
            param.VAR_POSITIONAL,
            param.VAR_KEYWORD,
        ):
            continue
        kwargs[param.name] = _argument(param.name)
    return factory(**kwargs)


def _gradient(type_name: str, seed: int):
    rng = np.random.default_rng(seed)
    m, n = SHAPE
    if type_name == "LowRank":
        return qt.LowRank(
            jnp.asarray(rng.standard_normal((m, 2)), jnp.float32),
            jnp.asarray(rng.standard_normal((n, 2)), jnp.float32),
        )
    if type_name == "SparseRows":
        rows = jnp.asarray(rng.standard_normal((3, n)), jnp.float32)
        return qt.SparseRows(jnp.array([1, 5, 1]), rows, m)
    dense = jnp.asarray(rng.standard_normal(SHAPE), jnp.float32)
    if type_name == "Quantized":
        return qt.quantize(dense, bits=8, block_size=8)
    return qt.sign_norm(dense, block_size=8)


def _params():
    return {
        "w": jnp.asarray(np.random.default_rng(9).standard_normal(SHAPE), jnp.float32)
    }


def _outcome(tx, type_name: str, jit: bool = False):
    """`None` when `tx` gives lift's updates on two steps, else the error raised.

    `tx` runs first; the reference only where it raised nothing (most raise on the
    first step), which keeps the check fast."""
    params = _params()
    grads = [{"w": _gradient(type_name, step)} for step in range(2)]
    # The loss value, for the transformations that take it (others ignore it).
    tx = optax.with_extra_args_support(tx)
    update = ft.partial(jax.jit(tx.update) if jit else tx.update, value=LOSS)
    state, got = tx.init(params), []
    try:
        # A transformation that hands the whole value to an operator (`p + g`) runs
        # the type's rules: exact, densified where it must be, and counted.
        with qt.fallback("silent"):
            for g in grads:
                updates, state = update(g, state, params)
                got.append(qt.materialise(updates)["w"])
    except Exception as error:  # noqa: BLE001
        return error
    reference = qto.lift(tx)
    state = reference.init(params)
    with qt.fallback("silent"):
        for g, actual in zip(grads, got):
            expected, state = reference.update(g, state, params, value=LOSS)
            assert_close(actual, expected["w"], factor=10)
    return None


NAMES = sorted(set(FACTORIES) - set(SKIPPED))


@pytest.mark.parametrize("type_name", TYPES)
def test_every_transformation_is_exact_or_names_a_fix(type_name):
    unclear = {}
    for name in NAMES:
        tx = _build(name)
        error = _outcome(tx, type_name)
        if error is not None and not any(fix in str(error) for fix in FIXES):
            unclear[name] = f"{type(error).__name__}: {str(error)[:300]}"
    assert not unclear, unclear


def test_the_skip_list_names_public_transformations():
    # A name optax drops (or renames) must leave the list, so that it stays short.
    assert set(SKIPPED) <= set(FACTORIES)


# The transformations a training loop reaches first, also under `jit`, where JAX's
# errors come from tracers rather than concrete arrays.
UNDER_JIT = (
    "sgd",
    "adam",
    "adamw",
    "lion",
    "scale_by_schedule",
    "add_decayed_weights",
    "clip_by_global_norm",
    "clip",
    "MultiSteps",
    "apply_every",
    "masked",
    "multi_transform",
    "centralize",
)


@pytest.mark.parametrize("name", UNDER_JIT)
def test_under_jit_exact_or_names_a_fix(name):
    error = _outcome(_build(name), "LowRank", jit=True)
    assert error is None or any(fix in str(error) for fix in FIXES), str(error)


def test_a_learning_rate_chained_after_projected_names_the_fix():
    # The measured case: the learning rate would scale both factors of the LowRank
    # update, an update lr times too small.
    tx = optax.chain(
        qto.projected(optax.scale_by_adam(), rank=2),
        optax.scale_by_learning_rate(1e-2),
    )
    params = {"w": jnp.zeros((6, 10))}
    rng = np.random.default_rng(0)
    projector = np.linalg.qr(rng.standard_normal((6, 2)))[0].astype(np.float32)
    g = qt.LowRank(
        jnp.asarray(projector),
        jnp.asarray(rng.standard_normal((10, 2)), jnp.float32),
        projector_side="left",
    )
    fix = r"quax_tangents\.optax\.projected\(\.\.\., learning_rate=\.\.\.\)"
    with pytest.raises(TypeError, match=fix):
        tx.update({"w": g}, tx.init(params))


@pytest.mark.parametrize("type_name", TYPES)
def test_optax_apply_updates_is_exact(type_name):
    # The parameters come first in its tree map, so each compressed update reaches
    # `p + u` whole and runs through its type's rules (densified, counted).
    params = _params()
    updates = {"w": _gradient(type_name, 0)}
    qt.reset_fallback_counts()
    with qt.fallback("silent"):
        out = optax.apply_updates(params, updates)
    assert_close(out["w"], params["w"] + qt.materialise(updates["w"]))
    assert qt.fallback_counts()


def test_the_check_sees_a_wrong_update():
    # A transformation that drops the guard (a filter for floating leaves) and
    # scales the factors: the comparison with `lift` must catch it.
    import equinox as eqx

    def scale_floating_leaves(updates, params):
        del params
        kept = eqx.filter(updates, eqx.is_inexact_array)
        return jax.tree.map(lambda g: -0.1 * g, kept)

    with pytest.raises(AssertionError, match="max error"):
        _outcome(optax.stateless(scale_floating_leaves), "LowRank")
