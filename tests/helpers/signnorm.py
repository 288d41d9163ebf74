"""Random `SignNorm` values and the property-test cases of the rules `SignNorm`
registers itself (those of every `BlockedArray` are in `tests/helpers/blocked.py`)."""

import numpy as np
from hypothesis import strategies as st

import quax_tangents as qt
from tests.helpers.blocked import batched_compressor, draw_input, register_own_cases


@st.composite
def signnorm_values(draw, event_shape=None, dtype=None, block_size=0, batch_shape=None):
    """A `SignNorm` of standard normal data (with some exact zeros). `block_size=0`
    draws one (None included). Batch dims come from vmapping `sign_norm`."""
    x, n_batch = draw_input(draw, event_shape, dtype, batch_shape)
    if block_size == 0:
        block_size = draw(st.sampled_from([None, 1, 3, 8]))
    x[np.abs(x.astype(np.float32)) < 0.2] = 0
    return batched_compressor(qt.sign_norm, n_batch, block_size)(x)


register_own_cases("SignNorm", signnorm_values)
