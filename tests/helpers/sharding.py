"""Property-test cases of the rules for sharding and device sums (`reshard` of
LowRank, OuterSum, SparseRows and a marked weight, `psum_invariant` and `pvary` of
LowRank, SparseRows and Sparse, `pvary` of a marked weight, `psum_invariant` of an
OuterSum), on a mesh of one device so that they run in any process. The multi-device
runs are in `tests/autodiff/test_shard_map.py`. Nothing here touches
devices at import: the mesh is made when a case is drawn."""

import functools as ft

import jax
import jax.numpy as jnp
from hypothesis import strategies as st
from jax import lax
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import quax_tangents as qt
from quax_tangents._marks._projection import outer_sum_p
from quax_tangents._types.outer import OuterSum
from tests.helpers import random_array, seeds
from tests.helpers.cases import Case, case
from tests.helpers.cotangents import _marked
from tests.helpers.lowrank import lowrank_values
from tests.helpers.rows import rows_values
from tests.helpers.sparse import sparse_values


AXIS = "x"


@ft.cache
def one_device_mesh() -> jax.sharding.Mesh:
    return jax.make_mesh(
        (1,), (AXIS,), axis_types=(AxisType.Explicit,), devices=jax.devices()[:1]
    )


def _resharded(spec: P, x):
    return jax.sharding.reshard(x, NamedSharding(one_device_mesh(), spec))


@case("reshard", "LowRank")
def _reshard():
    specs = st.sampled_from([P(), P(AXIS), P(None, AXIS)])

    @st.composite
    def draw(draw):
        x = draw(lowrank_values(batch_dims=0))
        spec = draw(specs)
        return Case(ft.partial(_resharded, spec), (x,), x.dtype, qt.LowRank)

    return draw()


def _on_one_device(body, x):
    """`body(x)` inside `shard_map` over the one-device mesh, replicated in and out."""
    return jax.shard_map(body, mesh=one_device_mesh(), in_specs=P(), out_specs=P())(x)


def _summed_over_devices(x):
    """`x` scaled by a device-varying scalar, then summed over the one device: the
    scalar varies, so `lax.psum` binds `psum_invariant` on the compressed value."""

    def body(a):
        return lax.psum(a * (lax.axis_index(AXIS) + 1).astype(a.dtype), AXIS)

    return _on_one_device(body, x)


@case("psum_invariant", "LowRank")
def _psum_invariant():
    return lowrank_values(batch_dims=0).map(
        lambda x: Case(_summed_over_devices, (x,), x.dtype, qt.LowRank)
    )


@case("psum_invariant", "SparseRows")
def _psum_invariant_rows():
    # A stacked table's rows too: every slice's stored rows are gathered.
    return rows_values().map(
        lambda x: Case(_summed_over_devices, (x,), x.dtype, qt.SparseRows)
    )


@case("psum_invariant", "Sparse")
def _psum_invariant_sparse():
    # With batch dims too: every batch element's entries are gathered.
    return sparse_values().map(
        lambda x: Case(_summed_over_devices, (x,), x.dtype, qt.Sparse)
    )


def _varied(x):
    """`x` typed as varying over the device axis, then summed over it."""

    def body(a):
        return lax.psum(qt.device_varying(a, AXIS), AXIS)

    return _on_one_device(body, x)


@case("pvary", "LowRank")
def _pvary():
    return lowrank_values(batch_dims=0).map(
        lambda x: Case(_varied, (x,), x.dtype, qt.LowRank)
    )


@case("pvary", "SparseRows")
def _pvary_rows():
    return rows_values().map(lambda x: Case(_varied, (x,), x.dtype, qt.SparseRows))


@case("pvary", "Sparse")
def _pvary_sparse():
    return sparse_values().map(lambda x: Case(_varied, (x,), x.dtype, qt.Sparse))


def _marked_varied(w):
    """A marked weight typed as varying over the device axis, then used in a matmul
    whose result is summed over it."""

    def body(a):
        eye = jnp.eye(a.shape[-1], dtype=a.dtype)
        return lax.psum(qt.device_varying(a, AXIS) @ eye, AXIS)

    return _on_one_device(body, w)


@case("pvary", "Marked")
def _pvary_marked():
    # Kinds whose matmul keeps the mark (a row-marked table's matmul is counted).
    kinds = st.sampled_from(["factored", "projected"])
    weights = kinds.flatmap(lambda kind: _marked(kind=kind, batch=()))
    return weights.map(lambda w: Case(_marked_varied, (w,), w.dtype))


def _outer_summed(a, b):
    """The OuterSum `a^T b` of device-varying factors, summed over the device axis."""

    def body(a, b):
        a, b = qt.device_varying((a, b), AXIS)
        return lax.psum(outer_sum_p.bind(a, b, batch_ndim=0), AXIS)

    spec = dict(mesh=one_device_mesh(), in_specs=(P(), P()), out_specs=P())
    return jax.shard_map(body, **spec)(a, b)


@case("psum_invariant", "OuterSum")
def _psum_invariant_outer():
    @st.composite
    def draw(draw):
        rows, m, n = (draw(st.integers(1, 5)) for _ in range(3))
        a = random_array(draw(seeds()), (rows, m))
        b = random_array(draw(seeds()), (rows, n))
        return Case(_outer_summed, (a, b), a.dtype, OuterSum)

    return draw()


def _outer_resharded(spec: P, a, b):
    """The OuterSum `a^T b`, resharded: as the cotangent of a mark is retyped as its
    weight."""
    return _resharded(spec, outer_sum_p.bind(a, b, batch_ndim=0))


@case("reshard", "OuterSum")
def _reshard_outer():
    @st.composite
    def draw(draw):
        rows, m, n = (draw(st.integers(1, 5)) for _ in range(3))
        a = random_array(draw(seeds()), (rows, m))
        b = random_array(draw(seeds()), (rows, n))
        spec = draw(st.sampled_from([P(), P(AXIS), P(None, AXIS)]))
        return Case(ft.partial(_outer_resharded, spec), (a, b), a.dtype, OuterSum)

    return draw()


@case("reshard", "SparseRows")
def _reshard_rows():
    # Replicated stays SparseRows; a spec that shards it is counted and dense.
    @st.composite
    def draw(draw):
        x = draw(rows_values(batch=()))
        spec = draw(st.sampled_from([P(), P(None, None), P(AXIS), P(None, AXIS)]))
        kept = not any(entry is not None for entry in spec)
        out_type = qt.SparseRows if kept else jax.Array
        return Case(ft.partial(_resharded, spec), (x,), x.dtype, out_type)

    return draw()


def _marked_resharded(spec: P, w):
    """A marked weight resharded before its matmul (an FSDP all-gather)."""
    eye = jnp.eye(w.shape[-1], dtype=w.dtype)
    return _resharded(spec, w) @ eye


@case("reshard", "Marked")
def _reshard_marked():
    @st.composite
    def draw(draw):
        kind = draw(st.sampled_from(["factored", "projected"]))
        w = draw(_marked(kind=kind, batch=()))
        spec = draw(st.sampled_from([P(), P(AXIS), P(None, AXIS)]))
        return Case(ft.partial(_marked_resharded, spec), (w,), w.dtype)

    return draw()
