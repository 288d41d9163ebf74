"""What each pass of `quax_tangents.optax.accumulate_gradients` over the microbatches
marks a projected leaf with: one module per kind of pass, each with the `mark` that
puts its `Finish` on the leaf (through its matrix view)."""

from typing import Any, ClassVar

import equinox as eqx
from jaxtyping import Array

from .._marks._cotangents import (
    bind_mark,
    projected_cotangent,
    sparse_rows_cotangent,
)
from .._marks._projection import Finish
from .._marks._sources import GivenInto, Sketch, SketchKey, SketchKeyInto
from ._galore_leaves import LeafPlan
from ._mark import in_matrix_view


# The range finder's oversampling, as `quax_tangents.optax.mark` draws it.
OVERSAMPLE = Finish("projected").oversample


class GivenProjector(eqx.Module):
    """A pass that projects with the projectors `matrix`: each mark adds its
    microbatch's `G^T P` (or `G Q`) into the running sum."""

    matrix: Array
    sketch: ClassVar[bool] = False
    into: ClassVar[bool] = True

    def mark(self, leaf: Any, plan: LeafPlan, total: Any, by_layer: bool, layout: Any):
        given = self.matrix.astype(leaf.dtype)
        width = self.matrix.shape[-1]
        if total is None:
            return in_matrix_view(
                leaf, plan, lambda w: projected_cotangent(w, width, projector=given)
            )
        # The mark adds this microbatch's factor to the running sum in place.
        spec = Finish(
            "projected", width, 0, GivenInto(), by_layer=by_layer, layout=layout
        )
        return in_matrix_view(leaf, plan, lambda w: bind_mark(spec, w, (given, total)))


class DrawnSketch(eqx.Module):
    """A pass that sketches each matrix with test matrices drawn from `keys`, one
    slice at a time inside the model's pass; each mark adds its microbatch's `G Ω`
    into the running sum."""

    keys: Array
    key_impl: str = eqx.field(static=True)
    sketch: ClassVar[bool] = True
    into: ClassVar[bool] = True

    def mark(self, leaf: Any, plan: LeafPlan, total: Any, by_layer: bool, layout: Any):
        if total is None:
            spec = Finish(
                "projected", plan.rank, 0, SketchKey(), self.key_impl, OVERSAMPLE
            )
            operands: tuple = (self.keys,)
        else:
            # In place, slice by slice, when the model scans over the stack.
            spec = Finish(
                "projected",
                plan.rank,
                0,
                SketchKeyInto(),
                self.key_impl,
                OVERSAMPLE,
                by_layer=by_layer,
                layout=layout,
            )
            operands = (self.keys, total)
        return in_matrix_view(leaf, plan, lambda w: bind_mark(spec, w, operands))


class GivenSketch(eqx.Module):
    """A pass that sketches each matrix with the test matrices `tests` (a power
    iteration's); the microbatches' sketches are summed after the pass."""

    tests: Array
    sketch: ClassVar[bool] = True
    into: ClassVar[bool] = False

    def mark(self, leaf: Any, plan: LeafPlan, total: Any, by_layer: bool, layout: Any):
        spec = Finish("projected", self.tests.shape[-1], 0, Sketch())
        return in_matrix_view(leaf, plan, lambda w: bind_mark(spec, w, (self.tests,)))


Mode = GivenProjector | DrawnSketch | GivenSketch


def mark_leaf(
    leaf: Any,
    plan: LeafPlan | None,
    mode: Mode | None,
    total: Any = None,
    by_layer: bool = True,
    layout: Any = None,
) -> Any:
    if plan is None or leaf is None:
        return leaf
    if plan.kind == "rows":
        return sparse_rows_cotangent(leaf)
    assert mode is not None  # a projected leaf always has a mode
    return mode.mark(leaf, plan, total, by_layer, layout)
