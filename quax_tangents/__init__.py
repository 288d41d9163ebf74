"""Compressed tangents and cotangents for JAX.

The optax transforms live in the submodule `quax_tangents.optax`, imported on first
use (it needs the `optax` extra); diagnostics read from compiled programs live in
`quax_tangents.hlo`.
"""

import importlib as _importlib
import importlib.metadata as _metadata
from typing import Any as _Any

from . import hlo as hlo
from ._autodiff import _control as _control, _shard_map as _shard_map
from ._autodiff._ad import (
    compress_cotangent as compress_cotangent,
    factored_matmul as factored_matmul,
    grad as grad,
    jvp as jvp,
    linearize as linearize,
    partial_jvp as partial_jvp,
    value_and_grad as value_and_grad,
    vjp as vjp,
)
from ._autodiff._forward import (
    ForwardGradInfo as ForwardGradInfo,
    GaussianDirections as GaussianDirections,
    LowRankDirections as LowRankDirections,
    SparseDirections as SparseDirections,
    forward_grad as forward_grad,
)
from ._core._base import (
    ChunkCompressor as ChunkCompressor,
    CompressedArray as CompressedArray,
)
from ._core._checkpoint import (
    tree_deserialise_leaves as tree_deserialise_leaves,
    tree_serialise_leaves as tree_serialise_leaves,
)
from ._core._deprecation import Alias as _Alias, resolve_alias as _resolve_alias
from ._core._devices import device_varying as device_varying
from ._core._fallback import (
    BudgetAction as BudgetAction,
    DensificationError as DensificationError,
    DensificationWarning as DensificationWarning,
    Densify as Densify,
    Recompress as Recompress,
    fallback as fallback,
    fallback_counts as fallback_counts,
    fallback_mode as fallback_mode,
    rank_budget as rank_budget,
    rank_budget_counts as rank_budget_counts,
    reset_fallback_counts as reset_fallback_counts,
)
from ._differentiable import (
    Differentiable as Differentiable,
    NoDerivative as NoDerivative,
    Static as Static,
    differentiable as differentiable,
    differentiable_part as differentiable_part,
    inner as inner,
    move as move,
    norm as norm,
    zero_tangent as zero_tangent,
)
from ._distributed._collective import (
    GatherSum as GatherSum,
    MajorityVote as MajorityVote,
    PowerSum as PowerSum,
    all_reduce as all_reduce,
)
from ._distributed._scatter import (
    TwoPhase as TwoPhase,
    reduce_scatter as reduce_scatter,
)
from ._distributed._schedule import Cheapest as Cheapest
from ._marks._cotangents import (
    Projector as Projector,
    factored_cotangent as factored_cotangent,
    projected_cotangent as projected_cotangent,
    sparse_rows_cotangent as sparse_rows_cotangent,
)
from ._types._primitives import compress as compress, materialise as materialise
from ._types.lowrank import LowRank as LowRank, low_rank as low_rank
from ._types.quantized import Quantized as Quantized, quantize as quantize
from ._types.rows import SparseRows as SparseRows
from ._types.signnorm import SignNorm as SignNorm, sign_norm as sign_norm
from ._types.sparse import Sparse as Sparse, top_k as top_k


__version__ = _metadata.version("quax-tangents")


__all__ = [
    "all_reduce",
    "BudgetAction",
    "Cheapest",
    "ChunkCompressor",
    "compress",
    "compress_cotangent",
    "CompressedArray",
    "DensificationError",
    "DensificationWarning",
    "Densify",
    "device_varying",
    "differentiable",
    "Differentiable",
    "differentiable_part",
    "factored_cotangent",
    "factored_matmul",
    "fallback",
    "fallback_counts",
    "fallback_mode",
    "forward_grad",
    "ForwardGradInfo",
    "LowRankDirections",
    "GaussianDirections",
    "SparseDirections",
    "GatherSum",
    "grad",
    "inner",
    "jvp",
    "linearize",
    "low_rank",
    "LowRank",
    "MajorityVote",
    "materialise",
    "move",
    "NoDerivative",
    "norm",
    "partial_jvp",
    "PowerSum",
    "projected_cotangent",
    "Projector",
    "quantize",
    "Quantized",
    "rank_budget",
    "rank_budget_counts",
    "Recompress",
    "reduce_scatter",
    "reset_fallback_counts",
    "sign_norm",
    "SignNorm",
    "Sparse",
    "sparse_rows_cotangent",
    "SparseRows",
    "Static",
    "top_k",
    "tree_deserialise_leaves",
    "tree_serialise_leaves",
    "TwoPhase",
    "value_and_grad",
    "vjp",
    "zero_tangent",
]

# Submodules that `__getattr__` imports on first access, and the extra each needs.
_LAZY_SUBMODULES = {"optax": "optax"}


def _from(module: str, name: str) -> _Any:
    return lambda: getattr(_importlib.import_module(f"{__name__}.{module}"), name)


# Old names, kept for one release: each use warns and names the new one.
_DEPRECATED = {
    name: _Alias(f"qt.{name}", f"qt.hlo.{name}", _from("hlo", name))
    for name in ("Collective", "collectives", "received_bytes", "schedule_bytes")
} | {
    "apply_tangent_updates": _Alias(
        "qt.apply_tangent_updates",
        "quax_tangents.optax.apply_updates",
        _from("_differentiable", "move"),
    )
}


def __getattr__(name: str) -> _Any:
    if name in _DEPRECATED:
        return _resolve_alias(_DEPRECATED[name])
    if name not in _LAZY_SUBMODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        return _importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as error:
        extra = _LAZY_SUBMODULES[name]
        if error.name != extra:
            raise
        raise ImportError(
            f"`{__name__}.{name}` needs the `{extra}` package, which is not "
            f'installed: `pip install "quax-tangents[{extra}]"`.'
        ) from error


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY_SUBMODULES))
