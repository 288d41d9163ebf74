"""Building rule outputs without value checks.

A rule's output is consistent by construction, and a public constructor's value
checks (finiteness) would both reject legitimate dense semantics such as `x * inf`
and force a device-to-host sync on every eager rule. Rules build their outputs with
`unchecked`, exactly as unflattening under `jit`/`vmap` does; public constructors keep
validating user input.
"""

import dataclasses
from typing import Any, TypeVar, cast


_T = TypeVar("_T")


def unchecked(cls: type[_T], **fields: Any) -> _T:
    """A module of `cls` from all of its fields, without running `__init__` or
    `__check_init__` (equinox runs `__check_init__` only from `__init__`).

    Fields with a default value take it when left out. Fields that `__init__` does
    not take (`init=False`) may be left out too; a class that fills them itself says
    how in a `_fill_unset_fields` method (compressed values set their guard leaf
    there)."""
    all_fields = dataclasses.fields(cast(Any, cls))
    names = {f.name for f in all_fields}
    defaults = {
        f.name: f.default
        for f in all_fields
        if f.init and f.default is not dataclasses.MISSING
    }
    required = {f.name for f in all_fields if f.init} - set(defaults)
    if not required <= set(fields) <= names:
        raise TypeError(
            f"{cls.__name__} needs fields {sorted(required)}, got {sorted(fields)}."
        )
    obj = object.__new__(cls)
    for name, value in {**defaults, **fields}.items():
        object.__setattr__(obj, name, value)
    if set(fields) != names:
        fill = getattr(obj, "_fill_unset_fields", None)
        if fill is not None:
            fill()
    return obj
