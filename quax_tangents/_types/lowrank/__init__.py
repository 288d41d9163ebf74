"""`LowRank`: an array stored as two thin factors, `left @ swapaxes(right, -1, -2)`.

The type and the helpers its rules share (`_array`), the compressor `low_rank`
(`_compress`), and every rule the type registers (`_rules`, imported here so that
they are registered wherever the type is).
"""

from . import _rules as _rules  # registers LowRank's rules
from ._array import (
    LowRank as LowRank,
    truncate as truncate,
    within_budget as within_budget,
)
from ._compress import low_rank as low_rank
