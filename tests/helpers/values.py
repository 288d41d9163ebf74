"""Deterministic compressed values of a given shape, one builder for every type."""

import numpy as np

import quax_tangents as qt
from tests.helpers import random_array
from tests.helpers.blocked import batched_compressor
from tests.helpers.sparse import random_sparse


TYPE_NAMES = ("LowRank", "Sparse", "Quantized", "SignNorm")


def compressed(type_name: str, shape: tuple[int, ...], seed: int = 0):
    """A float32 value of `type_name` of `shape` whose leading `ndim - 2` dims are
    batch dims, or `None` when the type has no such value (LowRank below two dims)."""
    n_batch = max(len(shape) - 2, 0)
    if type_name == "LowRank":
        if len(shape) < 2:
            return None
        lead, (m, n) = shape[:-2], shape[-2:]
        left = random_array(seed, (*lead, m, 2))
        right = random_array(seed + 1, (*lead, n, 2))
        return qt.LowRank(left, right)
    if type_name == "Sparse":
        size = int(np.prod(shape[n_batch:]))
        return random_sparse(seed, shape, min(3, size), batch_dims=n_batch)
    x = random_array(seed, shape)
    if type_name == "Quantized":
        return batched_compressor(qt.quantize, n_batch, 8, 4)(x)
    if type_name == "SignNorm":
        return batched_compressor(qt.sign_norm, n_batch, 4)(x)
    raise ValueError(f"unknown type {type_name!r}")
