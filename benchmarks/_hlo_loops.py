"""Bytes a device receives per step from a compiled program's collectives, with each
collective inside a `while` loop (a `lax.scan` or `fori_loop`) counted once per
iteration: `quax_tangents.collectives` lists it once."""

import re

import quax_tangents as qt


_COMPUTATION = re.compile(r"^\s*(?:ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$")
_WHILE = re.compile(r"\bwhile\(.*?body=%?([\w.\-]+)")
_TRIP = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLS = re.compile(
    r"(?:to_apply|calls|body|condition|true_computation|false_computation"
    r"|branch_computations)=\{?%?([\w.\-]+)"
)
_NAME = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=")


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name."""
    found: dict[str, list[str]] = {}
    current = None
    for line in hlo.splitlines():
        match = _COMPUTATION.match(line)
        if match and "=" not in line.split("{")[0].split("(")[0]:
            current = match.group(1)
            found[current] = []
        elif current is not None:
            found[current].append(line)
    return found


def multiplicities(hlo: str) -> dict[str, int]:
    """How many times each computation runs per call of the entry computation: the
    product of the known trip counts of the `while` loops around it."""
    computations = _computations(hlo)
    entry = next(
        match.group(1)
        for line in hlo.splitlines()
        if line.startswith("ENTRY")
        for match in [_COMPUTATION.match(line)]
        if match
    )
    times = {entry: 1}
    stack = [entry]
    while stack:
        name = stack.pop()
        for line in computations.get(name, []):
            trips = 1
            loop = _WHILE.search(line)
            if loop:
                trip = _TRIP.search(line)
                trips = int(trip.group(1)) if trip else 1
            for callee in _CALLS.findall(line):
                count = times[name] * (trips if loop and callee == loop.group(1) else 1)
                if times.get(callee, 0) < count:
                    times[callee] = count
                    stack.append(callee)
    return times


def received_per_step(hlo: str, collectives: list, devices: int) -> float:
    """The bytes one device receives per call of the program whose text is `hlo`:
    each of its `collectives` (`quax_tangents.collectives` of the same program)
    counted with `quax_tangents.received_bytes`, times how often it runs."""
    times = multiplicities(hlo)
    where = {}
    for name, lines in _computations(hlo).items():
        for line in lines:
            match = _NAME.match(line)
            if match:
                where[match.group(1).lstrip("%")] = name
    return sum(
        qt.received_bytes(c, devices) * times.get(where.get(c.name, ""), 1)
        for c in collectives
    )
