"""What each pass of `quax_tangents.optax.accumulate_gradients` over the microbatches
marks a projected leaf with: one `Phased` mark, whose phase (an operand, not a
parameter) says which product with the gradient the pass adds up, so that every
pass of a step, a refresh's included, is one compiled pass."""

from typing import Any

import equinox as eqx
from jaxtyping import Array

from .._marks._cotangents import bind_mark, sparse_rows_cotangent
from .._marks._projection import Finish
from .._marks._sources import Phased
from ._galore_leaves import LeafPlan
from ._mark import in_matrix_view


class PhasedPass(eqx.Module):
    """One trip of the pass: each projected matrix is marked with its `matrix`
    (`(*batch, small, rank)`: the projector, or a refresh's basis), the key data
    of its test matrices, the shared `phase` and, with power iterations, its test
    matrices `tests` (`(*batch, large, rank)`); each mark adds its microbatch's
    product into the running sum `(*batch, large, rank)` (see `Phased`)."""

    matrix: Array
    keys: Array
    phase: Array
    tests: Array | None
    key_impl: str = eqx.field(static=True)

    def mark(self, leaf: Any, plan: LeafPlan, total: Any, by_layer: bool, layout: Any):
        source = Phased(tested=self.tests is not None, summed=total is not None)
        spec = Finish(
            "projected",
            plan.rank,
            0,
            source,
            self.key_impl,
            0,
            by_layer=by_layer,
            layout=layout,
        )
        operands = (self.matrix.astype(leaf.dtype), self.keys, self.phase)
        if self.tests is not None:
            operands += (self.tests.astype(leaf.dtype),)
        if total is not None:
            operands += (total,)
        return in_matrix_view(leaf, plan, lambda w: bind_mark(spec, w, operands))


def mark_leaf(
    leaf: Any,
    plan: LeafPlan | None,
    mode: PhasedPass | None,
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
