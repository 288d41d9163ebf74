"""A reader of the bytes that a compiled program's collectives move, from its HLO."""

import dataclasses
import functools
import math
import re
from collections.abc import Callable
from typing import Any

import jax


_COLLECTIVES = (
    "all-reduce",
    "all-gather",
    "reduce-scatter",
    "all-to-all",
    "ragged-all-to-all",
    "collective-permute",
    "collective-broadcast",
)

_ITEMSIZE = {
    "pred": 1,
    "s8": 1,
    "u8": 1,
    "f8e4m3fn": 1,
    "f8e5m2": 1,
    "s16": 2,
    "u16": 2,
    "f16": 2,
    "bf16": 2,
    "s32": 4,
    "u32": 4,
    "f32": 4,
    "s64": 8,
    "u64": 8,
    "f64": 8,
    "c64": 8,
    "c128": 16,
}

_ARRAY = re.compile(r"([a-z][a-z0-9]*)\[([0-9,]*)\]")
_COMMENT = re.compile(r"/\*.*?\*/")
_INSTRUCTION = re.compile(r"^\s*(?:ROOT\s+)?%?([^\s=]+)\s*=\s*(.*)$")
_COMPUTATION = re.compile(r"^\s*(ENTRY\s+)?%?([\w.\-]+)\s*(?:\(.*\)\s*->.*)?\{\s*$")
_WHILE_PARTS = re.compile(r"\b(body|condition)=%?([\w.\-]+)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"\}')
_CALLEE = re.compile(
    r"\b(?:to_apply|calls|true_computation|false_computation)=%?([\w.\-]+)"
)
_CALLEE_LIST = re.compile(r"\b(?:branch_computations|calls)=\{([^}]*)\}")
_CHANNEL = re.compile(r"\bchannel_id=(\d+)")
_CHAIN = re.compile(r'\bchain_id="([^"]*)"')


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program, as `collectives` reads it.

    - `kind`: the HLO opcode without an async `-start` suffix, e.g. `"all-reduce"`.
    - `name`: the instruction's name in the HLO module (the first copy's, for a
        TPU's asynchronous collective).
    - `operand_shapes`: the HLO shapes of its operands, e.g. `("f32[64,4]",)`.
    - `operand_bytes`: the bytes of its operands on one device: what that device puts
        on the wire (an all-gather receives this from every other device; a ring
        all-reduce sends and receives about twice it).
    - `count`: how many times it runs per call of the program: the product of the
        trip counts of the `while` loops (`lax.scan`, `fori_loop`) around it, `1`
        outside loops: the count XLA:CPU annotates, or else the one the loop's
        counter shows (a TPU compile annotates none, nor does a program read before
        XLA's passes). `None` when a loop around it has neither (a `while_loop`
        with a data-dependent condition):
        [`quax_tangents.hlo.received_bytes`][] then refuses to give a per-step figure
        rather than guess one. A branch of a `cond` counts as running every time its
        `cond` does (an upper bound).
    """

    kind: str
    name: str
    operand_shapes: tuple[str, ...]
    operand_bytes: int
    count: int | None = 1


def shape_bytes(shape: str) -> int:
    """The bytes of an HLO shape such as `f32[64,4]{1,0}` or a tuple of them."""
    total = 0
    for dtype, dims in _ARRAY.findall(shape):
        if dtype not in _ITEMSIZE:
            raise ValueError(f"Unknown HLO element type {dtype!r} in {shape!r}.")
        size = math.prod(int(d) for d in dims.split(",") if d)
        total += size * _ITEMSIZE[dtype]
    return total


def _split_shape(rhs: str) -> tuple[str, str]:
    """Splits `"<shape> <opcode>(...)..."` after the shape, which may be a tuple."""
    if rhs.startswith("("):
        depth = 0
        for i, char in enumerate(rhs):
            depth += {"(": 1, ")": -1}.get(char, 0)
            if depth == 0:
                return rhs[: i + 1], rhs[i + 1 :].lstrip()
    shape, _, rest = rhs.partition(" ")
    return shape, rest


def _operand_names(call: str) -> list[str]:
    """The operand names of `"opcode(%a, %b), attrs"` (operands may carry shapes)."""
    start = call.index("(") + 1
    depth, end = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(call[end], 0)
        end += 1
    inside = call[start : end - 1]
    return [token.split()[-1].lstrip("%") for token in inside.split(", ") if token]


def _strip_layout(shape: str) -> str:
    return re.sub(r"\{[^}]*\}", "", shape)


def collectives_in_hlo(
    hlo: str, *, unknown_trips: int | None = None, branch: int | None = None
) -> list[Collective]:
    """Every collective instruction of an HLO module's text (`compiled.as_text()`),
    in order, with its operands' shapes looked up from their definitions.

    An instruction inside a loop body is listed once, with the number of times it
    runs per call of the module as its `count` (see [`quax_tangents.hlo.Collective`][]),
    and so is a TPU compile's asynchronous collective, whose instruction is repeated
    in each fusion of the chain that starts it, overlaps it with computation and ends
    it (copies marked with one `chain_id` and one `channel_id`);
    a loop whose trip count XLA does not know counts as `unknown_trips` trips, or
    makes the count `None`. Every branch of a conditional counts as run, or with
    `branch` only that one (its index: 0 for `lax.cond`'s false branch, 1 for its
    true branch).
    """
    shapes: dict[str, str] = {}
    calls: list[tuple[str, str, str, str | None]] = []
    computation = None
    for line in hlo.splitlines():
        # Long operand lists carry comments such as `/*index=5*/`.
        line = _COMMENT.sub("", line)
        header = _computation_header(line)
        if header is not None:
            computation = header[1]
            continue
        match = _INSTRUCTION.match(line)
        if match is None or line.lstrip().startswith("HloModule"):
            continue
        name, rhs = match.groups()
        shape, call = _split_shape(rhs.strip())
        shapes[name] = shape
        opcode = call.split("(", 1)[0].strip()
        kind = opcode.removesuffix("-start")
        if kind in _COLLECTIVES and "(" in call:
            calls.append((kind, name, call, computation))
    counts = computation_counts(hlo, unknown_trips, branch)
    found = []
    channels: set[tuple[str, str, str]] = set()
    for kind, name, call, where in calls:
        # The TPU compiler runs a collective asynchronously as a chain of fusions
        # (its start, the computations it overlaps, its end), each holding a copy of
        # the instruction marked with the chain's `chain_id` and the collective's
        # `channel_id`: one collective. (A `channel_id` alone is not unique: XLA
        # gives some distinct collectives the same one.)
        chain, channel = _CHAIN.search(call), _CHANNEL.search(call)
        if chain is not None and channel is not None:
            key = (kind, chain.group(1), channel.group(1))
            if key in channels:
                continue
            channels.add(key)
        operands = tuple(_strip_layout(shapes[o]) for o in _operand_names(call))
        count = counts.get(where, 1) if where is not None else 1
        found.append(
            Collective(
                kind, name, operands, sum(shape_bytes(s) for s in operands), count
            )
        )
    return found


def _computation_header(line: str) -> tuple[bool, str] | None:
    """`(is_entry, name)` if `line` opens a computation, such as
    `%body.3 (p: (s32[], f32[8])) -> (s32[], f32[8]) {` or `ENTRY %main {`."""
    if "=" in line.split("(", 1)[0]:
        return None  # An instruction, `%x = ...`.
    match = _COMPUTATION.match(line)
    if match is None:
        return None
    return bool(match.group(1)), match.group(2)


def _callees(
    line: str,
    unknown_trips: int | None,
    branch: int | None = None,
    counter: "_Counter | None" = None,
) -> list[tuple[str, int | None]]:
    """The computations an instruction line calls, each with how many times it runs
    per run of the instruction (for a loop, the trip count XLA annotates, or else the
    one its counter shows (`_Counter`), or else `unknown_trips`; for a conditional, 1
    for every branch, or with `branch` 1 for that branch and 0 for the others)."""
    match = _INSTRUCTION.match(line)
    call = _split_shape(match.group(2).strip())[1] if match else ""
    if call.startswith("while("):
        trip = _TRIP_COUNT.search(line)
        trips = int(trip.group(1)) if trip else None
        if trips is None and counter is not None:
            trips = counter.trips(call)
        if trips is None:
            trips = unknown_trips
        return [(str(name), trips) for _, name in _WHILE_PARTS.findall(line)]
    if call.startswith("conditional(") and branch is not None:
        listed = _CALLEE_LIST.search(line)
        if listed:
            names = [n.strip().lstrip("%") for n in listed.group(1).split(",")]
        else:  # a predicate's two computations: `false` is branch 0, `true` 1
            pairs = re.findall(r"\b(true|false)_computation=%?([\w.\-]+)", line)
            by_branch: dict[str, str] = dict(pairs)
            names = [by_branch.get("false", ""), by_branch.get("true", "")]
        return [(n, int(k == branch)) for k, n in enumerate(names) if n]
    found: list[tuple[str, int | None]] = [(n, 1) for n in _CALLEE.findall(line)]
    for names in _CALLEE_LIST.findall(line):
        found += [(n.strip().lstrip("%"), 1) for n in names.split(",") if n.strip()]
    return found


_GET_ELEMENT = re.compile(r"^get-tuple-element\(%?[\w.\-]+\), index=(\d+)")
_CONSTANT = re.compile(r"^constant\((-?\d+)\)")


class _Counter:
    """Trip counts of `while` loops that XLA does not annotate, read from the loop's
    own counter. A TPU compile annotates none (XLA:CPU writes `known_trip_count`),
    and a program read before XLA's passes has none yet; a `lax.scan` or
    `lax.fori_loop` still shows its count as a counter: the condition's root is
    `compare(get-tuple-element(param, k), constant(N)), direction=LT`, the loop's
    initial tuple holds `constant(S)` at `k`, and the body's root tuple holds
    `add(get-tuple-element(param, k), constant(c))` there, maybe through copies and
    bitcasts (`c` is 1, or the stride of a loop XLA rewrote, such as the TPU's
    windowed matmuls). Such a loop runs `ceil((N - S) / c)` times, at least 0; any
    other loop (a `lax.while_loop` on a traced condition) has no count here."""

    def __init__(self, hlo: str):
        self.definitions: dict[str, str] = {}
        self.roots: dict[str, str] = {}
        current = None
        for line in hlo.splitlines():
            line = _COMMENT.sub("", line)
            header = _computation_header(line)
            if header is not None:
                current = header[1]
                continue
            match = _INSTRUCTION.match(line)
            if match is None or line.lstrip().startswith("HloModule"):
                continue
            name, rhs = match.groups()
            call = _split_shape(rhs.strip())[1]
            self.definitions[name] = call
            if line.lstrip().startswith("ROOT") and current is not None:
                self.roots[current] = call

    def _resolved(self, name: str) -> str:
        """The definition of `name`, seen through copies and bitcasts."""
        call = self.definitions.get(name, "")
        for _ in range(16):
            opcode = call.split("(", 1)[0]
            if opcode not in ("copy", "bitcast", "convert") or "(" not in call:
                break
            call = self.definitions.get(_operand_names(call)[0], "")
        return call

    def _constant(self, name: str) -> int | None:
        match = _CONSTANT.match(self._resolved(name))
        return int(match.group(1)) if match else None

    def _element(self, name: str) -> int | None:
        match = _GET_ELEMENT.match(self._resolved(name))
        return int(match.group(1)) if match else None

    def trips(self, call: str) -> int | None:
        """The trip count of the `while(...)` instruction `call`, or None."""
        parts = dict((kind, name) for kind, name in _WHILE_PARTS.findall(call))
        condition = self.roots.get(parts.get("condition", ""), "")
        body = self.roots.get(parts.get("body", ""), "")
        if not condition.startswith("compare(") or not body.startswith("tuple("):
            return None
        left, right = _operand_names(condition)[:2]
        if "direction=LT" in condition:
            index, bound = self._element(left), self._constant(right)
        elif "direction=GT" in condition:
            index, bound = self._element(right), self._constant(left)
        else:
            return None
        start_tuple = self._resolved(_operand_names(call)[0])
        if index is None or bound is None or not start_tuple.startswith("tuple("):
            return None
        starts, steps = _operand_names(start_tuple), _operand_names(body)
        if index >= min(len(starts), len(steps)):
            return None
        start = self._constant(starts[index])
        step = self._resolved(steps[index])
        if start is None or not step.startswith("add("):
            return None
        a, b = _operand_names(step)[:2]
        if self._element(a) != index:
            a, b = b, a
        stride = self._constant(b)
        if self._element(a) != index or stride is None or stride < 1:
            return None
        return max(-(-(bound - start) // stride), 0)


def computation_counts(
    hlo: str, unknown_trips: int | None = None, branch: int | None = None
) -> dict[str, int | None]:
    """How many times each computation of an HLO module runs per call of its entry
    computation: the sum over its call sites of the caller's count times the trip
    count of the loop that calls it (`1` for other calls). A loop with no known trip
    count counts `unknown_trips` times, or makes the counts below it `None`. Empty
    if the text has no `ENTRY` computation."""
    edges: dict[str, list[tuple[str, int | None]]] = {}
    entry = current = None
    counter = _Counter(hlo)
    for line in hlo.splitlines():
        line = _COMMENT.sub("", line)
        header = _computation_header(line)
        if header is not None:
            is_entry, current = header
            edges[current] = []
            entry = current if is_entry else entry
        elif current is not None and _INSTRUCTION.match(line):
            edges[current] += _callees(line, unknown_trips, branch, counter)
    if entry is None:
        return {}
    order: list[str] = []  # Callers before callees: reversed depth-first post-order.
    seen: set[str] = set()

    def visit(name: str) -> None:
        seen.add(name)
        for callee, _ in edges.get(name, []):
            if callee not in seen:
                visit(callee)
        order.append(name)

    visit(entry)
    counts: dict[str, int | None] = {name: 0 for name in order}
    counts[entry] = 1
    for name in reversed(order):
        for callee, times in edges.get(name, []):
            caller, before = counts[name], counts[callee]
            if caller is None or times is None or before is None:
                counts[callee] = None
            else:
                counts[callee] = before + caller * times
    return counts


def collectives(
    fn: Callable[..., Any],
    *args: Any,
    unknown_trips: int | None = None,
    branch: int | None = None,
    **kwargs: Any,
) -> list[Collective]:
    """Lowers and compiles `fn(*args, **kwargs)` and lists its collectives with the
    bytes of their operands, read from the compiled HLO (after XLA's passes, so
    combined, promoted or removed collectives show as they run).

    An instruction inside a loop (a `lax.scan` body) is listed once, with how many
    times it runs per call as its `count`: the product of the trip counts of the
    loops around it, as XLA annotates them or as their counters show (`None` if
    one of them is unknown, as it is for a `lax.while_loop` on a traced condition,
    unless `unknown_trips` is given).

    **Arguments:**

    - `fn`: a function, jitted or not (it is wrapped in `jax.jit` if it has no
        `lower`), typically a `jax.shard_map` step. Or, given no arguments: a
        `jax.stages.Compiled`, read as it is; or a `jax.stages.Lowered`, read before
        XLA's optimisations, which shows what the program asks for (XLA's CPU compiler,
        for one, promotes bfloat16 all-reduces to float32).
    - `*args`, `**kwargs`: example arguments (arrays, or `jax.ShapeDtypeStruct`s with
        their shardings).
    - `unknown_trips`: the trips to count for a loop whose trip count XLA does not
        know; an upper bound on them gives an upper bound on each `count`.
    - `branch`: count only this branch of every conditional (`lax.cond`, whose
        false branch is 0 and true branch 1); `None` counts every branch as run, an
        upper bound. A step with [`quax_tangents.optax.accumulate_gradients`][]
        refreshes its projectors in the true branch of a `lax.cond`: `branch=1`
        counts a refresh step, `branch=0` a step that keeps them.

    **Returns:**

    A list of [`quax_tangents.hlo.Collective`][], one per collective instruction, in the
    order of the HLO text; on a TPU compile, one per asynchronous collective, whose
    chain of fusions repeats its instruction under one `chain_id` (counting each
    copy would count its bytes once per fusion of the chain).
    """
    stages = (jax.stages.Compiled, jax.stages.Lowered)
    if isinstance(fn, stages) and (args or kwargs):
        raise TypeError("A lowered or compiled program takes no example arguments.")
    if unknown_trips is not None and (
        isinstance(unknown_trips, bool)
        or not isinstance(unknown_trips, int)
        or unknown_trips < 0
    ):
        raise ValueError(
            f"`unknown_trips` must be a non-negative int or None, got {unknown_trips!r}."
        )
    if branch is not None and (
        isinstance(branch, bool) or not isinstance(branch, int) or branch < 0
    ):
        raise ValueError(
            f"`branch` must be a non-negative int or None, got {branch!r}."
        )
    read = functools.partial(
        collectives_in_hlo, unknown_trips=unknown_trips, branch=branch
    )
    if isinstance(fn, jax.stages.Compiled):
        return read(_text(fn.as_text()))
    if isinstance(fn, jax.stages.Lowered):
        return read(_text(fn.compiler_ir("hlo")).as_hlo_text())
    lowerable: Any = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = lowerable.lower(*args, **kwargs).compile()
    return read(_text(compiled.as_text()))


def _text(x: Any) -> Any:
    if x is None:
        raise ValueError(
            "This compiled program has no HLO text to read collectives from."
        )
    return x


def received_bytes(collective: Collective, devices: int, *, per: str = "call") -> float:
    """The bytes one device receives for `collective` on `devices` devices, under the
    usual algorithms (what grows with the device count, unlike `operand_bytes`), per
    call of the program: a collective inside loops counts once per iteration.

    With `b` the collective's operand bytes on one device:

    - all-gather: every other device's operand, `(n - 1) b` (that is `(n - 1) / n` of
        its result);
    - all-to-all: every piece of the operand but its own, `(n - 1) / n * b`;
    - reduce-scatter: `(n - 1)` times its result, `(n - 1) / n * b`;
    - all-reduce (a ring: a reduce-scatter then an all-gather): `2 (n - 1) / n * b`;
    - collective-permute and collective-broadcast: `b`.

    **Arguments:**

    - `collective`: one entry of [`quax_tangents.hlo.collectives`][].
    - `devices`: the number of devices `n` that take part in it.
    - `per`: `"call"` (the default): per call of the program, `count` times the
        bytes of one run. `"run"`: one run of the instruction, however many times a
        loop runs it.

    **Returns:**

    The bytes, a float (`0.0` on one device).

    **Raises:**

    `ValueError` for `per="call"` when a loop around the collective has no known trip
    count (`collective.count is None`): pass `per="run"` and multiply by the trip
    count you know, or read the compiled program, whose loops XLA has counted.
    """
    n, b = devices, collective.operand_bytes
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"`devices` must be a positive int, got {devices!r}.")
    if per not in ("call", "run"):
        raise ValueError(f'`per` must be "call" or "run", got {per!r}.')
    count = 1 if per == "run" else collective.count
    if count is None:
        raise ValueError(
            f"The {collective.kind} {collective.name!r} runs inside a loop whose trip "
            "count XLA does not know, so its bytes per call are unknown. Pass "
            "`per='run'` for the bytes of one run and multiply by the trip count, "
            "read a compiled program (`jax.jit(f).lower(...).compile()`), or, for a "
            "`lax.while_loop` on a traced condition, give "
            "`quax_tangents.hlo.collectives` `unknown_trips=` (an upper bound on its "
            "trips)."
        )
    factors = {
        "all-gather": n - 1,
        "all-to-all": (n - 1) / n,
        "ragged-all-to-all": (n - 1) / n,
        "reduce-scatter": (n - 1) / n,
        "all-reduce": 2 * (n - 1) / n,
    }
    if n == 1:
        return 0.0
    return factors.get(collective.kind, 1) * b * count
