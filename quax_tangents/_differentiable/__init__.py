"""`@differentiable` classes: structures that differentiate some of their fields.

After Swift for TensorFlow's `Differentiable` protocol. A decorated class has three
kinds of field:

- *differentiable* fields, which `quax_tangents.grad` and `quax_tangents.jvp`
  differentiate, and which make up the generated `Model.Tangent`;
- *non-differentiable data* (S4TF's `@noDerivative`): pytree children that stay
  dynamic under `jit` (running statistics, step counters) and never get a tangent;
- *static* fields: hashable aux data of the pytree (names, hyperparameters).

The class stays a pytree of its own type: flatten then unflatten gives a `Model` back,
so `scan`, `cond`, `jit`, `vmap` and friends work on it. Differentiation goes through
the hook that `quax_tangents.grad`/`jvp` look for: `__qt_split__` splits a model into
its differentiable part (a `Model.Tangent` holding the fields' values) and the rest,
and `__qt_merge__` puts them back together.

The package: `_fields` (markers, reading annotations), `_checks`, `_tangent` (the
generated Tangent class), `_pytree` (registration, splitting and merging), `_ops`
(operations on models and Tangents) and `_decorator`.
"""

from ._decorator import differentiable as differentiable
from ._fields import (
    Differentiable as Differentiable,
    NoDerivative as NoDerivative,
    Static as Static,
    is_differentiable_instance as is_differentiable_instance,
)
from ._ops import (
    differentiable_part as differentiable_part,
    inner as inner,
    move as move,
    norm as norm,
    zero_tangent as zero_tangent,
)
from ._pytree import (
    merge_structures as merge_structures,
    split_structures as split_structures,
    through_views as through_views,
)
