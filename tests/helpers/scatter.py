"""Helpers of the two-phase and reduce-scatter tests: the multi-device helpers of
`tests.helpers.collective` on a mesh of all 8 host CPU devices.

Nothing here touches devices at import: the rule tests import every helper module.
"""

import functools as ft

from tests.helpers import collective
from tests.helpers.collective import AXIS as AXIS, quadratic_grad


DEVICES = 8

enough_devices = ft.partial(collective.enough_devices, DEVICES)
mesh = ft.partial(collective.mesh, devices=DEVICES)
on_mesh = ft.partial(collective.on_mesh, devices=DEVICES)
split = ft.partial(collective.split, devices=DEVICES)
least_squares = ft.partial(collective.quadratic, m=32, n=16, rows=24, devices=DEVICES)
least_squares_grad = quadratic_grad
