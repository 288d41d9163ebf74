"""`Sparse`: a k-sparse array of (flat index, value) pairs, and its compressor `top_k`.

A `Sparse` stores `indices` and `values` of shape `(*batch, k)`. Each index is a flat,
row-major index into the trailing "event" dimensions `event_shape`; the represented
dense array has shape `(*batch, *event_shape)`. Duplicate indices add up. Rules keep
the value sparse wherever the exact result is sparse, by remapping indices (reshape,
transpose, reductions), gathering the dense operand at the indices (elementwise
products, `dot_general`) or concatenating along `k` (sums of two `Sparse`).

The type and the helpers its rules share (`_array`, with the compressor `top_k`),
and every rule the type registers (`_rules`, imported here so that they are
registered wherever the type is).
"""

from . import _rules as _rules  # registers Sparse's rules
from ._array import Sparse as Sparse, top_k as top_k
