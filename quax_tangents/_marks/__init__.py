"""Cotangent marks: weights whose gradients are born compressed. The marks themselves
(`_cotangents`), the construction primitives of their cotangents (`_projection`, and
`_slices` for a stack projected one slice at a time), one type per source of a
projection's projector (`_sources`), the marked weight seen through row reads, scans,
`shard_map` and reshapes (`_marked_*`), weights marked through their matrix view
(`_matrix_view`), and the check of a user's projector (`_orthonormal`)."""

# `Marked`'s rules (and the slices' primitives') live in one module per kind of use;
# importing them registers them, here, in one place (`_marked.py` holds the type
# they all build on).
from . import (  # noqa: F401
    _marked_dot,
    _marked_rows,
    _marked_sharding,
    _marked_views,
    _slices,
)
