"""Diagnostics read from a compiled program: the collectives it runs and the bytes
they move (`collectives`, `Collective`, `received_bytes`), and the bytes each
all-reduce schedule would move for a compressed value (`schedule_bytes`).

```python
import quax_tangents as qt

for c in qt.hlo.collectives(step, params, batch):
    print(c.kind, c.operand_shapes, qt.hlo.received_bytes(c, devices=8))
```
"""

from ._distributed._hlo import (
    Collective as Collective,
    collectives as collectives,
    received_bytes as received_bytes,
)
from ._distributed._schedule import schedule_bytes as schedule_bytes


__all__ = ["Collective", "collectives", "received_bytes", "schedule_bytes"]
