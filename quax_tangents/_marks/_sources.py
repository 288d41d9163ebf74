"""Where a projection's projector comes from: one type per source, as the `source`
of a `Finish` spec (`quax_tangents._marks._projection`).

A source says which operands follow the cotangent into `finish_p`, which of them
hold one entry per slice of a stacked weight, and whether the result is a
projection or a sketch, and whether it is added to a running sum. The types hold no
arrays: they are static parameters of a primitive, equal when their types are.
"""

from typing import ClassVar

import equinox as eqx


class Source(eqx.Module):
    """Where a projection's projector comes from (see the subclasses)."""

    # Per operand after the cotangent: whether it holds one entry per slice of a
    # stacked weight (a projector, key data, a sum) or is shared by all (`refresh`).
    per_slice: ClassVar[tuple[bool, ...]]
    # The first operand is the projector, used as given.
    given: ClassVar[bool] = False
    # The result is a sketch `G Ω` of the matrix, not a projection.
    sketch: ClassVar[bool] = False
    # The last operand is a running sum `S` that the result adds to (affine in `G`).
    into: ClassVar[bool] = False

    def linear(self) -> "Source":
        """The same source without the running sum: the part linear in `G`."""
        return self


class Given(Source):
    """Operands: the projector `P`. Gives `LowRank(P, G^T P)`."""

    per_slice = (True,)
    given = True


class GivenInto(Source):
    """Operands: the projector `P` and a sum `S` of earlier factors. Gives
    `LowRank(P, S + G^T P)`, written over `S` slice by slice: how
    `quax_tangents.optax.accumulate_gradients` adds microbatches up without a second
    factor-sized buffer."""

    per_slice = (True, True)
    given = True
    into = True

    def linear(self) -> Source:
        return Given()


class Fresh(Source):
    """Operands: the key data. The projector is found from `G` by a randomized range
    finder."""

    per_slice = (True,)


class Switch(Source):
    """Operands: the projector, a bool saying "refresh", and the key data: the given
    projector or a fresh one, as a `lax.cond`."""

    per_slice = (True, False, True)


class Sketch(Source):
    """Operands: a test matrix `Ω`. Gives the sketch `G Ω`."""

    per_slice = (True,)
    sketch = True


class SketchKey(Source):
    """Operands: the key data that `Ω` is drawn from (as `Fresh`'s range finder
    draws it), one slice at a time. Gives the sketch `G Ω`."""

    per_slice = (True,)
    sketch = True


class SketchKeyInto(Source):
    """Operands: the key data and a sum `S` of earlier sketches. Gives `S + G Ω`."""

    per_slice = (True, True)
    sketch = True
    into = True

    def linear(self) -> Source:
        return SketchKey()
