"""Random `Quantized` values and the property-test cases of the rules `Quantized`
registers itself (those of every `BlockedArray` are in `tests/helpers/blocked.py`)."""

from hypothesis import strategies as st

import quax_tangents as qt
from tests.helpers.blocked import batched_compressor, draw_input, register_own_cases


@st.composite
def quantized_values(
    draw, event_shape=None, dtype=None, bits=None, block_size=None, batch_shape=None
):
    """A `Quantized` of standard normal data. Batch dims (drawn unless given) come from
    vmapping `quantize`, as they do in use."""
    x, n_batch = draw_input(draw, event_shape, dtype, batch_shape)
    bits = draw(st.sampled_from([4, 8])) if bits is None else bits
    if block_size is None:
        block_size = draw(st.sampled_from([2, 4, 256]))
    return batched_compressor(qt.quantize, n_batch, bits, block_size)(x)


register_own_cases("Quantized", quantized_values)
