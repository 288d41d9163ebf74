"""Whether a projector has orthonormal columns: checked where a user hands one in.

A projector `P` that is not orthonormal makes `P P^T G` something other than a
projection of `G`, silently. The check runs eagerly on concrete arrays; on traced
arrays it runs inside the program (`equinox.error_if`) when `qt.fallback("error")` is
active or `jax_enable_checks` is set, since it costs a `(rank, rank)` product per call.
"""

import math
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import numpy as np

from .._core._fallback import fallback_mode
from .._core._sharding import batched_gram
from .._core._validate import is_concrete


def orthonormality_tolerance(dtype: Any, side: int) -> float:
    """How far `P^T P` may be from the identity for a projector stored in `dtype`
    whose columns have `side` entries: rounding each entry to `dtype` moves each
    entry of `P^T P` by at most about `2 eps(dtype)`, and an orthonormalisation
    computed in float32 leaves about `sqrt(side) eps(float32)`."""
    eps = float(jnp.finfo(dtype).eps)
    work_eps = float(jnp.finfo(jnp.promote_types(dtype, jnp.float32)).eps)
    return 8 * eps + 8 * math.sqrt(max(side, 1)) * work_eps


def _unit_or_zero_diagonal(xp: Any, gram: Any) -> Any:
    """What `P^T P` should be: the identity, except that a zero column (the range
    finder's answer for a gradient of lower rank than the projector) stays zero;
    `P P^T` is then the projection onto the nonzero columns' span. A matrix of zeros
    only is no projector."""
    diagonal = xp.diagonal(gram, axis1=-2, axis2=-1)
    units = xp.where(diagonal > 0.5, 1.0, 0.0).astype(gram.dtype)
    # All zero is the placeholder of a refresh step, not a projector: the identity.
    units = xp.where(xp.any(units > 0, axis=-1, keepdims=True), units, 1.0)
    return units[..., :, None] * xp.eye(gram.shape[-1], dtype=gram.dtype)


def orthonormality_error(matrix: Any) -> Any:
    """`max |P^T P - I|` over the last two dims (the batch dims of a stack too)."""
    work = jnp.promote_types(jnp.result_type(matrix), jnp.float32)
    p = jnp.asarray(matrix).astype(work)
    gram = batched_gram(p)
    return jnp.max(jnp.abs(gram - _unit_or_zero_diagonal(jnp, gram)))


def _message(name: str, error: Any, tolerance: float) -> str:
    return (
        f"`{name}` must have orthonormal columns (P^T P = I, zero columns allowed), but "
        f"max|P^T P - I| = {error} exceeds {tolerance:.2g}, the tolerance for its "
        "dtype: the result would not be a projection of the gradient. Orthonormalise "
        "it first (`jnp.linalg.qr(p)[0]`), or pass `projector=None` for a fresh one."
    )


def checks_in_program() -> bool:
    """Whether traced projectors are checked inside the compiled program."""
    return fallback_mode() == "error" or bool(jax.config.values["jax_enable_checks"])


def check_orthonormal(matrix: Any, name: str, *, skip: Any = False) -> Any:
    """Returns `matrix`, after checking that its columns are orthonormal.

    Concrete: raises a `ValueError` now. Traced: with `checks_in_program()`, the
    returned array raises when the program runs (`equinox.error_if`); otherwise it
    is `matrix` unchecked. `skip` (a bool, traced or not) turns the check off, for
    the placeholder of a `Projector` that asks for a fresh projector.
    """
    shape = jnp.shape(matrix)
    if len(shape) < 2 or not jnp.issubdtype(jnp.result_type(matrix), jnp.floating):
        return matrix
    tolerance = orthonormality_tolerance(jnp.result_type(matrix), shape[-2])
    if is_concrete(matrix) and is_concrete(skip):
        if bool(np.asarray(skip)):
            return matrix
        # numpy, not jnp: a concrete projector may be met while a trace is active.
        work = np.float64 if jnp.result_type(matrix) == jnp.float64 else np.float32
        p = np.asarray(matrix).astype(work)
        gram = np.swapaxes(p, -1, -2) @ p
        error = float(np.max(np.abs(gram - _unit_or_zero_diagonal(np, gram))))
        if not error <= tolerance:
            raise ValueError(_message(name, f"{error:.3g}", tolerance))
        return matrix
    if not checks_in_program():
        return matrix
    bad = jnp.logical_and(
        jnp.logical_not(jnp.asarray(skip)),
        jnp.logical_not(orthonormality_error(matrix) <= tolerance),
    )
    return eqx.error_if(matrix, bad, _message(name, "more", tolerance))
