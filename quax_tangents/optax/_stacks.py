"""Which stacked leaves an update takes whole, so that `quantized_state` can refuse to
decode a whole stack's state at once.

`projected` says which of its leaves are stacks of matrices (a scanned model's
blocks, `(layers, m, n)`) while it runs its base; `layerwise` says that the update
it runs takes one layer's slice at a time. `quantized_state`, which decodes the
state it updates to float32, reads both: a stack decoded whole outside `layerwise`
holds every layer's state in float32 at once.
"""

import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

import jax.tree_util as jtu

from ._galore_leaves import LeafPlan


Stacks = tuple[tuple[str, int], ...]  # (path, layers) per stacked leaf

_handed_whole: contextvars.ContextVar[Stacks] = contextvars.ContextVar(
    "quax_tangents_stacks_handed_whole", default=()
)
_per_layer: contextvars.ContextVar[bool] = contextvars.ContextVar(
    "quax_tangents_per_layer", default=False
)


def stacked_leaves(plan: Any) -> Stacks:
    """The leaves that a `projected` plan (`ProjectedState.plan`) projects as stacks
    of more than one matrix: `(path, layers)`, `layers` the leading dim."""
    found, _ = jtu.tree_flatten_with_path(
        plan, is_leaf=lambda x: x is None or isinstance(x, LeafPlan)
    )
    return tuple(
        (jtu.keystr(path) or "the root", leaf.shape[0])
        for path, leaf in found
        if isinstance(leaf, LeafPlan)
        and leaf.kind == "project"
        and leaf.batch_ndim
        and leaf.shape[0] > 1
    )


@contextlib.contextmanager
def handing_whole(stacks: Stacks) -> Iterator[None]:
    """Around `projected`'s call of its base: the base's update sees these stacks'
    factors whole."""
    token = _handed_whole.set(stacks)
    try:
        yield
    finally:
        _handed_whole.reset(token)


@contextlib.contextmanager
def per_layer() -> Iterator[None]:
    """Around `layerwise`'s update: the updates traced inside take one layer's slice
    of each stack (or, for the leaves it passes whole, a choice it made)."""
    token = _per_layer.set(True)
    try:
        yield
    finally:
        _per_layer.reset(token)


def refuse_whole_decode(stacks: Stacks) -> None:
    """Raises a `ValueError` naming the default pipeline if a stack in `stacks`, or
    one that an enclosing `projected` hands its base whole, would be decoded for all
    its layers at once (outside `layerwise`)."""
    stacks = _handed_whole.get() + stacks
    if not stacks or _per_layer.get():
        return
    path, layers = stacks[0]
    raise ValueError(
        "`quax_tangents.optax.quantized_state` would decode the 8-bit state of the "
        f"stacked leaf `{path}` ({layers} layers) to float32 for every layer at once "
        "(a 1B Llama's step of one microbatch, `benchmarks/bench_scale.py` before "
        "this was refused: 9.43 GiB compiled for CPU, 0.93x BF16 Adam's, and 7.15 "
        "for a TPU v5e chip, against 4.86 and 6.78 for `qto.galore`'s). Use the "
        "pipeline that updates one layer at a time, "
        "`qto.galore(rank=..., learning_rate=..., project=...)` with "
        "`opt.value_and_grad`, `opt.update` and `opt.apply`; or wrap this "
        f"transformation as `qto.layerwise(..., layers={layers})`."
    )
