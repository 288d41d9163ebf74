"""Cases of the rules every compressed type shares (symbolic zeros), in `_base.py`."""

import jax
from hypothesis import strategies as st
from quax.examples.zero import Zero

from quax_tangents._core._base import CompressedArray
from quax_tangents._core._lax import add_any_p
from tests.helpers.cases import Case, case
from tests.helpers.lowrank import lowrank_values
from tests.helpers.quantized import quantized_values
from tests.helpers.signnorm import signnorm_values
from tests.helpers.sparse import sparse_values


def compressed_values():
    """A value of any compressed type."""
    return st.one_of(
        lowrank_values(), sparse_values(), quantized_values(), signnorm_values()
    )


def _with_zero(fn, zero_first):
    def build(x):
        zero = Zero(x.shape, x.dtype)
        args = (zero, x) if zero_first else (x, zero)
        return Case(fn, args, x.dtype, CompressedArray)

    return compressed_values().map(build)


@case("add_any", "CompressedArray", "Zero")
def _add_any_right():
    return _with_zero(add_any_p.bind, zero_first=False)


@case("add_any", "Zero", "CompressedArray")
def _add_any_left():
    return _with_zero(add_any_p.bind, zero_first=True)


@case("add", "CompressedArray", "Zero")
def _add_right():
    return _with_zero(jax.lax.add, zero_first=False)


@case("add", "Zero", "CompressedArray")
def _add_left():
    return _with_zero(jax.lax.add, zero_first=True)


@case("sub", "CompressedArray", "Zero")
def _sub_right():
    return _with_zero(jax.lax.sub, zero_first=False)


@case("sub", "Zero", "CompressedArray")
def _sub_left():
    return _with_zero(jax.lax.sub, zero_first=True)
