"""The table of property-test cases, one per registered rule.

A case is a hypothesis strategy drawing `Case(fn, args)`: `fn` is written with
`jax.lax`/`jax.numpy`, and binding it on `args` must hit the rule under test. The
rule-consistency test runs `quax.quaxify(fn)(*args)` and compares it with
`fn(*materialise(args))`. Type modules in this package add their cases with `@case`.
"""

import dataclasses
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp


CASES: dict[tuple[str, tuple[str, ...]], Callable[[], Any]] = {}


@dataclasses.dataclass
class Case:
    fn: Callable[..., Any]
    args: tuple[Any, ...]
    # The dtype whose rounding the comparison allows (default: float32).
    dtype: Any = jnp.float32
    # If set, the quaxified output must be an instance of this type.
    out_type: type | tuple[type, ...] | None = None
    # Extra slack for lossy or reordered arithmetic, in multiples of the tolerance.
    factor: float = 1.0
    # Magnitude the error is measured against, where larger than max |expected|
    # (at least 1): the size of a sum whose terms may cancel.
    scale: float | None = None


def case(primitive: str, *operands: str):
    """Registers a strategy factory as the case for rule `(primitive, operands)`.

    Operand labels are those of `quax_tangents._core._registry.type_label`: class names,
    and `dense` for `ArrayLike`.
    """

    def register(strategy_factory):
        key = (primitive, tuple(operands))
        if key in CASES:
            raise ValueError(f"Two cases for rule {key}.")
        CASES[key] = strategy_factory
        return strategy_factory

    return register


def load_all_cases() -> dict[tuple[str, tuple[str, ...]], Callable[[], Any]]:
    """Imports every helper module in this package, so that their cases register."""
    import importlib
    import pkgutil

    from tests import helpers

    for module in pkgutil.iter_modules(helpers.__path__):
        importlib.import_module(f"tests.helpers.{module.name}")
    return CASES


# `jnp`/`lax` wrappers skip the primitive when it would do nothing (a conversion to the
# same dtype, an identity permutation or reshape); cases bind it, so the rule runs.
def bind_convert(dtype):
    return lambda a: jax.lax.convert_element_type_p.bind(
        a, new_dtype=jnp.dtype(dtype), weak_type=False, sharding=None
    )


def bind_transpose(permutation):
    return lambda a: jax.lax.transpose_p.bind(a, permutation=tuple(permutation))


def bind_reshape(new_sizes, dimensions=None):
    dimensions = None if dimensions is None else tuple(dimensions)
    return lambda a: jax.lax.reshape_p.bind(
        a, new_sizes=tuple(new_sizes), dimensions=dimensions, sharding=None
    )
