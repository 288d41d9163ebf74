"""Optax gradient transformations that compress updates: a generic compressor with
error feedback (EF, EF21), and PowerSGD; and optimisers that take compressed
gradients: `projected` (GaLore on projected and row-sparse gradients, whose updates
stay compressed; apply them with `apply_updates`; `mark` applies the marks its state
calls for inside the loss, and `accumulate_gradients` adds microbatches up inside one
step) and `lift` (any optax transformation, on the dense arrays).

Each compressing transformation emits *dense* updates: the materialised compressed value, or the
mean over devices of the compressed values. Generic optax transformations (`adam`,
`sgd`, `clip_by_global_norm`) map over array leaves: handed a compressed value they
would scale its factors or indices instead of the array it represents, so they raise a
`TypeError` that names the fix (`lift`, `projected`, `apply_updates`). The bytes that
compression saves are those on the wire: give `axis_name` and call the transformation
inside a `jax.shard_map` body, and the only collectives it runs move compressed fields.

With `axis_name`, part of the state differs per device (the carried errors). Call
`init` inside the `shard_map` body, and pass the state in and out of `shard_map` with
the specs of [`quax_tangents.optax.partition_specs`][]:

```python
tx = optax.chain(qto.powersgd(4, axis_name="data"), optax.adam(1e-3))
state_specs = qto.partition_specs(jax.eval_shape(tx.init, params), "data")
init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=state_specs)

def step(params, state, batch):  # runs on each device
    grads = jax.grad(loss)(qt.device_varying(params, "data"), batch)
    updates, state = tx.update(grads, state, params)
    return optax.apply_updates(params, updates), state
```
"""

import importlib.util
from typing import Any as _Any


if importlib.util.find_spec("optax") is None:
    raise ImportError(
        "`quax_tangents.optax` needs the `optax` package, which is not installed: "
        '`pip install "quax-tangents[optax]"`.'
    )

# ruff: noqa: E402
from .._core._deprecation import Alias as _Alias, resolve_alias as _resolve_alias
from .._marks._cotangents import LayerByLayerWarning as LayerByLayerWarning
from ._accumulate import accumulate_gradients as accumulate_gradients
from ._apply import apply_updates as apply_updates, lift as lift
from ._clip import clip_by_global_norm as clip_by_global_norm
from ._compress import (
    EF21 as EF21,
    CompressState as CompressState,
    ErrorFeedback as ErrorFeedback,
    compress_updates as compress_updates,
)
from ._decay import Decayed as Decayed
from ._galore import GaLore as GaLore, galore as galore
from ._layerwise import layerwise as layerwise
from ._mark import mark as mark
from ._powersgd import PowerSGDState as PowerSGDState, powersgd as powersgd
from ._projected import (
    ProjectedState as ProjectedState,
    projected as projected,
    projectors as projectors,
)
from ._quantized_state import (
    LogQuantized as LogQuantized,
    QuantizedState as QuantizedState,
    log_quantize as log_quantize,
    quantized_state as quantized_state,
)
from ._specs import partition_specs as partition_specs


__all__ = [
    "EF21",
    "CompressState",
    "Decayed",
    "ErrorFeedback",
    "GaLore",
    "LayerByLayerWarning",
    "LogQuantized",
    "PowerSGDState",
    "ProjectedState",
    "QuantizedState",
    "accumulate_gradients",
    "apply_updates",
    "clip_by_global_norm",
    "compress_updates",
    "galore",
    "layerwise",
    "lift",
    "log_quantize",
    "mark",
    "partition_specs",
    "powersgd",
    "projected",
    "projectors",
    "quantized_state",
]


# Old names, kept for one release: each use warns and names the new one.
_DEPRECATED = {
    "compress": _Alias(
        "qto.compress", "qto.compress_updates", lambda: compress_updates
    ),
}


def __getattr__(name: str) -> _Any:
    if name in _DEPRECATED:
        return _resolve_alias(_DEPRECATED[name])
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
