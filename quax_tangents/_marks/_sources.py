"""Where a projection's projector comes from: one type per source, as the `source`
of a `Finish` spec (`quax_tangents._marks._projection`).

A source says which operands follow the cotangent into `finish_p`, which of them
hold one entry per slice of a stacked weight, and whether the result is added to a
running sum. The types hold no
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
    # The last operand is a running sum `S` that the result adds to (affine in `G`).
    into: ClassVar[bool] = False

    def linear(self) -> "Source":
        """The same source without the running sum: the part linear in `G`."""
        return self


class Given(Source):
    """Operands: the projector `P`. Gives `LowRank(P, G^T P)`."""

    per_slice = (True,)
    given = True


class Fresh(Source):
    """Operands: the key data. The projector is found from `G` by a randomized range
    finder."""

    per_slice = (True,)


class Switch(Source):
    """Operands: the projector, a bool saying "refresh", and the key data: the given
    projector or a fresh one, as a `lax.cond`."""

    per_slice = (True, False, True)


class Phased(Source):
    """Operands: a matrix `M` (`small x r`), the key data of the test matrix, the
    phase (an int32 scalar shared by all slices), a test matrix `T` (`large x r`)
    when `tested`, and a sum `S` (`large x r`) when `summed`. Gives `LowRank(M, F)`
    whose factor `F` is, by phase (`PHASE_*`):

    - `PHASE_GIVEN`: `S + G^T M`, the projection with the projector `M` (`Given`)
      added to the sum;
    - `PHASE_DRAWN`: `S + G Ω` in the first `small` rows (the rest of `S` as it
      was), for the `large x r` test matrix `Ω` drawn from the key, as the range
      finder draws it with no oversampling;
    - `PHASE_TESTED`: `S + G T` in the same rows (a power iteration).

    One mark whose phase is an operand, not a parameter: every pass of a refresh
    (`quax_tangents.optax.accumulate_gradients`) is the same compiled pass, run as
    the trips of one loop. Outside `PHASE_GIVEN` the `LowRank` is a carrier of `F`
    only: its dense value is not a gradient."""

    tested: bool = False
    summed: bool = True

    @property
    def per_slice(self) -> tuple[bool, ...]:  # type: ignore[override]
        return (True, True, False) + (True,) * (self.tested + self.summed)

    @property
    def into(self) -> bool:  # type: ignore[override]
        return self.summed

    def linear(self) -> Source:
        return Phased(tested=self.tested, summed=False)


PHASE_GIVEN, PHASE_DRAWN, PHASE_TESTED = 0, 1, 2
