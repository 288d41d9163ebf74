"""Sums of compressed values across devices, moving only the compressed fields, and a
reader of the bytes that a compiled program's collectives move.

Everything here runs inside the body of `jax.shard_map` (or anything else that binds a
named axis), on concrete compressed values whose fields are traced arrays: no quax
trace is involved, so `check_vma=True` types every field like any other array.

Why not `jax.lax.psum`: handed a compressed value, `lax.psum` flattens it and sums its
fields, which is not the sum of the arrays it represents (the sum of the left factors
times the sum of the right factors is not the sum of the products; summed indices
point elsewhere; summed int8 codes wrap). JAX flattens pytrees before any type could
object, so this cannot be made to raise; `all_reduce` is the path to use.
"""

import dataclasses
import math
import re
from collections.abc import Callable, Hashable
from typing import Any

import equinox as eqx
import jax
import jax.numpy as jnp
import jax.tree_util as jtu
from jax import lax
from jaxtyping import Array, Float, PyTree

from ._base import CompressedArray
from ._types.lowrank import LowRank
from ._types.quantized import Quantized
from ._types.signnorm import SignNorm
from ._types.sparse import Sparse


AxisName = Hashable | tuple[Hashable, ...]


# ---------------------------------------------------------------------------------------
# Methods


class GatherSum(eqx.Module):
    """The exact sum, by an all-gather of every compressed field.

    Each device sends its own fields once, so the bytes sent per device are the
    compressed bytes, whatever the number of devices. Results:

    - `LowRank`: a `LowRank` whose factors hold every device's factors (rank
        `devices * r`).
    - `Sparse`: a `Sparse` holding every device's entries (`devices * k`).
    - `Quantized`, `SignNorm`: a dense array, every device's value decoded and summed
        in float32, then cast to the value's dtype.
    """


class PowerSum(eqx.Module):
    """A rank-`r` approximation of the sum of `LowRank` values by PowerSGD rounds
    (Vogels et al., 2019), for `r` the rank of the input.

    Each round all-reduces `P = sum_i M_i Q` (`m x r`), orthonormalises it on every
    device alike, and all-reduces `Q = sum_i M_i^T P` (`n x r`): `r * (m + n)` elements
    of the value's dtype per matrix per round instead of `m * n`. Products and the
    orthonormalisation run in (at least) float32; what crosses the wire is cast to the
    value's dtype. The result is the `LowRank` `P Q^T`.
    It is exact when the sum has rank at most `r` and the start `Q` spans its row space;
    otherwise it is the projection of the sum onto the range of `P`.

    **Arguments:**

    - `iters`: rounds (power iterations); each sharpens a decaying spectrum.
    - `seed`: seed of the starting `Q`, a standard normal matrix drawn from a constant
        key, so that it is identical on every device without communication.
    """

    iters: int = eqx.field(default=1, static=True)
    seed: int = eqx.field(default=0, static=True)

    def __check_init__(self) -> None:
        if isinstance(self.iters, bool) or not isinstance(self.iters, int):
            raise TypeError(f"`iters` must be an int, got {self.iters!r}.")
        if self.iters < 1:
            raise ValueError(f"`iters` must be at least 1, got {self.iters}.")


class MajorityVote(eqx.Module):
    """signSGD with majority vote (Bernstein et al., 2018) for `SignNorm` values.

    Every device's sign bits and norms are all-gathered. Each element of the result
    takes the sign held by most devices (a tie counts as `+`, like a zero); the norm
    of each block is the sum of the devices' norms of that block (their mean with
    `mean=True`). The result is a `SignNorm`. It equals the exact sum when the devices
    agree on every sign and have equal magnitudes, and is a biased estimate otherwise.
    """


Method = GatherSum | PowerSum | MajorityVote


# ---------------------------------------------------------------------------------------
# Axis helpers


def _axes(axis_name: AxisName) -> tuple[Hashable, ...]:
    return axis_name if isinstance(axis_name, tuple) else (axis_name,)


def axis_is_bound(axis_name: AxisName) -> bool:
    """Whether every named axis is bound here (inside `shard_map`, `vmap` etc.)."""
    try:
        for axis in _axes(axis_name):
            lax.axis_size(axis)
    except NameError:
        return False
    return True


def _vary_leaf(x: Any, axes: tuple[Hashable, ...]) -> Any:
    x = jnp.asarray(x)
    missing = tuple(a for a in axes if a not in jax.typeof(x).mat.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def device_varying(tree: PyTree, axis_name: AxisName) -> PyTree:
    """Marks every array of `tree` as varying over `axis_name` (`lax.pcast(...,
    to="varying")`, that is `pvary`), leaving arrays that already vary unchanged.

    Differentiate with respect to `device_varying(params, axis_name)` inside a
    `shard_map` body to get each device's own gradient of a replicated weight. Without
    it, JAX's AD inserts a dense all-reduce of the weight's gradient (the transpose of
    the implicit `pvary` of the weight) before any compressor sees the gradient. With
    `check_vma=False` nothing is typed and this returns `tree` unchanged.

    **Arguments:**

    - `tree`: a pytree of arrays or compressed values.
    - `axis_name`: a mesh axis name, or a tuple of them.

    **Returns:**

    The same values, typed as varying over `axis_name`.
    """
    axes = _axes(axis_name)
    return jtu.tree_map(lambda x: _vary_leaf(x, axes), tree)


def axis_size(axis_name: AxisName) -> int:
    """The number of devices along `axis_name` (the product for a tuple of axes)."""
    return math.prod(lax.axis_size(a) for a in _axes(axis_name))


def _gather(x: Array, axis_name: AxisName) -> Array:
    """Every device's `x`, stacked on a new leading axis, identical on every device.

    The input is made varying first, so that an input that is already replicated is
    gathered rather than rejected under `check_vma=True`.
    """
    return lax.all_gather(
        _vary_leaf(x, _axes(axis_name)), axis_name, axis=0, to="invarying"
    )


def _reduce(x: Array, axis_name: AxisName, mean: bool) -> Array:
    x = _vary_leaf(x, _axes(axis_name))
    return lax.pmean(x, axis_name) if mean else lax.psum(x, axis_name)


# ---------------------------------------------------------------------------------------
# PowerSGD rounds, shared with `quax_tangents.optax.powersgd`


def orthonormalise(p: Float[Array, "*batch m r"]) -> Float[Array, "*batch m r"]:
    """Orthonormal columns spanning those of `p`, by Gram-Schmidt done twice.

    A column that is zero after removing the previous ones (a zero gradient, or a
    rank lower than `r`) stays zero instead of becoming NaN, which a plain QR or a
    normalisation without a guard gives for rank 1 and 2. Each column is divided by
    its largest magnitude before its norm is taken, so tiny columns (whose squares
    underflow) are normalised, not dropped. Running the projections twice keeps the
    columns orthogonal to rounding ("twice is enough").

    **Arguments:**

    - `p`: floating array `(..., m, r)`; `r` is small (a Python loop over columns).

    **Returns:**

    An array of `p`'s shape and dtype, computed in at least float32.
    """
    dtype = p.dtype
    work = p.astype(jnp.promote_types(dtype, jnp.float32))
    columns: list[Array] = []
    for j in range(work.shape[-1]):
        v = work[..., j]
        for _ in range(2):
            for u in columns:
                v = v - jnp.sum(u * v, axis=-1, keepdims=True) * u
        largest = jnp.max(jnp.abs(v), axis=-1, keepdims=True)
        nonzero = largest > 0
        unit = v / jnp.where(nonzero, largest, 1.0)
        # At least 1 where the column is nonzero: its largest entry is now 1.
        norm = jnp.linalg.norm(unit, axis=-1, keepdims=True)
        columns.append(jnp.where(nonzero, unit / jnp.where(nonzero, norm, 1.0), 0.0))
    return jnp.stack(columns, axis=-1).astype(dtype)


def power_rounds(
    apply: Callable[[Array], Array],
    apply_transposed: Callable[[Array], Array],
    q: Array,
    iters: int,
    reduce: Callable[[Array], Array],
) -> tuple[Array, Array]:
    """`iters` PowerSGD rounds on the matrix `M = reduce(M_i)` that each device holds
    a term `M_i` of, without forming it: returns `(P, Q)` with orthonormal `P` and
    `P @ Q^T` the approximation of `M`.

    **Arguments:**

    - `apply`: `q -> M_i @ q`, this device's term applied to an `(n, r)` matrix.
    - `apply_transposed`: `p -> M_i^T @ p`.
    - `q`: the start `(n, r)`, identical on every device.
    - `iters`: the number of rounds.
    - `reduce`: the all-reduce (sum or mean over devices; the identity on one device).
    """
    p = None
    for _ in range(iters):
        p = orthonormalise(reduce(apply(q)))
        q = reduce(apply_transposed(p))
    return p, q


def start_q(key: jax.Array, shape: tuple[int, ...], dtype: Any) -> Array:
    """A standard normal start for PowerSGD, from a key that every device shares."""
    return jax.random.normal(key, shape, dtype)


def _matmul_t(a: Array, b: Array) -> Array:
    """`swapaxes(a, -1, -2) @ b` as one contraction."""
    return jnp.einsum("...mn,...mk->...nk", a, b)


def _power_sum(x: LowRank, axis_name: AxisName, method: PowerSum, mean: bool):
    work = jnp.promote_types(x.dtype, jnp.float32)
    left, right = x.left.astype(work), x.right.astype(work)
    *batch, n, r = right.shape
    q = start_q(jax.random.key(method.seed), (*batch, n, r), work)
    p, q = power_rounds(
        lambda q: left @ _matmul_t(right, q),
        lambda p: right @ _matmul_t(left, p),
        q,
        method.iters,
        # Computed in float32, sent in the value's own dtype.
        lambda a: _reduce(a.astype(x.dtype), axis_name, mean).astype(work),
    )
    return LowRank(p.astype(x.dtype), q.astype(x.dtype))


# ---------------------------------------------------------------------------------------
# Exact sums by all-gather


def _devices_to_axis(gathered: Array, axis: int) -> Array:
    """Moves the leading device axis next to `axis` of the original and merges them."""
    moved = jnp.moveaxis(gathered, 0, axis - 1 if axis < 0 else axis)
    shape = list(gathered.shape[1:])
    shape[axis] *= gathered.shape[0]
    return moved.reshape(shape)


def _gather_lowrank(x: LowRank, axis_name: AxisName, mean: bool) -> LowRank:
    left = _devices_to_axis(_gather(x.left, axis_name), -1)
    right = _devices_to_axis(_gather(x.right, axis_name), -1)
    if mean:
        left = left / jnp.asarray(axis_size(axis_name), left.dtype)
    return LowRank(left, right)


def _gather_sparse(x: Sparse, axis_name: AxisName, mean: bool) -> Sparse:
    indices = _devices_to_axis(_gather(x.indices, axis_name), -1)
    values = _devices_to_axis(_gather(x.values, axis_name), -1)
    if mean:
        values = values / jnp.asarray(axis_size(axis_name), values.dtype)
    return Sparse(indices, values, x.shape)


def _gathered_quantized(x: Quantized, axis_name: AxisName) -> Quantized:
    return Quantized(
        _gather(x.codes, axis_name),
        _gather(x.scales, axis_name),
        event_shape=x.event_shape,
        bits=x.bits,
        block_size=x.block_size,
        dtype=jnp.float32,
    )


def _gathered_signnorm(x: SignNorm, axis_name: AxisName) -> SignNorm:
    return SignNorm(
        _gather(x.bits, axis_name),
        _gather(x.norms, axis_name),
        event_shape=x.event_shape,
        block_size=x.block_size,
        dtype=jnp.float32,
    )


def _decoded_sum(
    gathered: CompressedArray, dtype: Any, axis_name: AxisName, mean: bool
) -> Array:
    # Decoded and summed in float32 whatever the value's dtype: a half-precision sum
    # over many devices would lose the small terms.
    total = jnp.sum(gathered.materialise(), axis=0)
    if mean:
        total = total / axis_size(axis_name)
    return total.astype(dtype)


def _majority_vote(x: SignNorm, axis_name: AxisName, mean: bool) -> SignNorm:
    gathered = _gathered_signnorm(x, axis_name)
    votes = jnp.sum(gathered.signs(), axis=0)
    bits = jnp.packbits(votes >= 0, axis=-1, bitorder="little")
    norms = jnp.sum(gathered.norms, axis=0)
    if mean:
        norms = norms / axis_size(axis_name)
    return SignNorm(
        bits, norms, event_shape=x.event_shape, block_size=x.block_size, dtype=x.dtype
    )


# ---------------------------------------------------------------------------------------
# all_reduce


def _reduce_leaf(x: Any, axis_name: AxisName, method: Method, mean: bool) -> Any:
    if not isinstance(x, CompressedArray):
        return _reduce(x, axis_name, mean)
    if isinstance(method, PowerSum):
        if not isinstance(x, LowRank):
            raise TypeError(
                f"`PowerSum` reduces LowRank values (and dense arrays), not a "
                f"{type(x).__name__}; use `GatherSum()` for an exact sum."
            )
        return _power_sum(x, axis_name, method, mean)
    if isinstance(method, MajorityVote):
        if not isinstance(x, SignNorm):
            raise TypeError(
                f"`MajorityVote` reduces SignNorm values (and dense arrays), not a "
                f"{type(x).__name__}; use `GatherSum()` for an exact sum."
            )
        return _majority_vote(x, axis_name, mean)
    if isinstance(x, LowRank):
        return _gather_lowrank(x, axis_name, mean)
    if isinstance(x, Sparse):
        return _gather_sparse(x, axis_name, mean)
    if isinstance(x, Quantized):
        return _decoded_sum(_gathered_quantized(x, axis_name), x.dtype, axis_name, mean)
    if isinstance(x, SignNorm):
        return _decoded_sum(_gathered_signnorm(x, axis_name), x.dtype, axis_name, mean)
    raise TypeError(f"No all-reduce for {type(x).__name__}.")


def all_reduce(
    tree: PyTree,
    axis_name: AxisName,
    method: Method | None = None,
    *,
    mean: bool = False,
) -> PyTree:
    """The sum (or mean) over devices of every value in `tree`, moving only the
    compressed fields of compressed values.

    Call it inside a `jax.shard_map` body (with `check_vma` on or off) on values that
    each device computed itself, for example its own gradient compressed with
    `quax_tangents.low_rank`. Dense arrays are summed with `lax.psum`. Compressed
    values are summed as `method` says:

    - [`quax_tangents.GatherSum`][] (the default, `None`): exact, by all-gathering the
        fields; LowRank and Sparse results stay compressed, Quantized and SignNorm
        results are dense sums computed in float32.
    - [`quax_tangents.PowerSum`][]: LowRank only; PowerSGD rounds, approximate,
        `r * (m + n)` elements per matrix per round.
    - [`quax_tangents.MajorityVote`][]: SignNorm only; a SignNorm of the majority signs.

    Values that are replicated (not varying over `axis_name`) are made varying first
    (`pvary`), so each device's copy counts once, as `lax.psum` counts it.

    Do not hand compressed values to `lax.psum` instead: it sums their fields, which is
    silently wrong (see this module's documentation). Inside a quaxified function
    `lax.psum` sees quax tracers; with `check_vma=True` it then raises (the values'
    types do not say they vary), and with `check_vma=False` it densifies, counted and
    subject to `quax_tangents.fallback`. Call `all_reduce` outside the quaxified
    function, on the values it returns.

    **Arguments:**

    - `tree`: a pytree of dense arrays and compressed values.
    - `axis_name`: the mesh axis (or tuple of axes) to reduce over.
    - `method`: how to reduce compressed values; `None` means `GatherSum()`.
    - `mean`: divide by the number of devices.

    **Returns:**

    A pytree of the same structure, identical (invariant) on every device.
    """
    method = GatherSum() if method is None else method
    if not isinstance(method, (GatherSum, PowerSum, MajorityVote)):
        raise TypeError(
            "`method` must be `GatherSum()`, `PowerSum(...)` or `MajorityVote()`, got "
            f"{method!r}."
        )
    return jtu.tree_map(
        lambda x: _reduce_leaf(x, axis_name, method, mean),
        tree,
        is_leaf=lambda x: isinstance(x, CompressedArray),
    )


# ---------------------------------------------------------------------------------------
# Bytes on the wire


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


@dataclasses.dataclass(frozen=True)
class Collective:
    """One collective of a compiled program, as `collectives` reads it.

    - `kind`: the HLO opcode without an async `-start` suffix, e.g. `"all-reduce"`.
    - `name`: the instruction's name in the HLO module.
    - `operand_shapes`: the HLO shapes of its operands, e.g. `("f32[64,4]",)`.
    - `operand_bytes`: the bytes of its operands on one device: what that device puts
        on the wire (an all-gather receives this from every other device; a ring
        all-reduce sends and receives about twice it).
    """

    kind: str
    name: str
    operand_shapes: tuple[str, ...]
    operand_bytes: int


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


def collectives_in_hlo(hlo: str) -> list[Collective]:
    """Every collective instruction of an HLO module's text (`compiled.as_text()`),
    in order, with its operands' shapes looked up from their definitions.

    An instruction inside a loop body is listed once, not once per iteration.
    """
    shapes: dict[str, str] = {}
    calls: list[tuple[str, str, str]] = []
    for line in hlo.splitlines():
        # Long operand lists carry comments such as `/*index=5*/`.
        line = _COMMENT.sub("", line)
        match = _INSTRUCTION.match(line)
        if match is None or line.lstrip().startswith(("HloModule", "ENTRY")):
            continue
        name, rhs = match.groups()
        shape, call = _split_shape(rhs.strip())
        shapes[name] = shape
        opcode = call.split("(", 1)[0].strip()
        kind = opcode.removesuffix("-start")
        if kind in _COLLECTIVES and "(" in call:
            calls.append((kind, name, call))
    found = []
    for kind, name, call in calls:
        operands = tuple(_strip_layout(shapes[o]) for o in _operand_names(call))
        found.append(
            Collective(kind, name, operands, sum(shape_bytes(s) for s in operands))
        )
    return found


def collectives(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> list[Collective]:
    """Lowers and compiles `fn(*args, **kwargs)` and lists its collectives with the
    bytes of their operands, read from the compiled HLO (after XLA's passes, so
    combined, promoted or removed collectives show as they run).

    An instruction inside a loop (a `lax.scan` body) is listed once, not once per
    iteration: the list of a scan over training steps is that of one step.

    **Arguments:**

    - `fn`: a function, jitted or not (it is wrapped in `jax.jit` if it has no
        `lower`), typically a `jax.shard_map` step. Or, given no arguments: a
        `jax.stages.Compiled`, read as it is; or a `jax.stages.Lowered`, read before
        XLA's optimisations, which shows what the program asks for (XLA's CPU compiler,
        for one, promotes bfloat16 all-reduces to float32).
    - `*args`, `**kwargs`: example arguments (arrays, or `jax.ShapeDtypeStruct`s with
        their shardings).

    **Returns:**

    A list of [`quax_tangents.Collective`][], one per collective instruction, in the
    order of the HLO text.
    """
    stages = (jax.stages.Compiled, jax.stages.Lowered)
    if isinstance(fn, stages) and (args or kwargs):
        raise TypeError("A lowered or compiled program takes no example arguments.")
    if isinstance(fn, jax.stages.Compiled):
        return collectives_in_hlo(fn.as_text())
    if isinstance(fn, jax.stages.Lowered):
        return collectives_in_hlo(fn.compiler_ir("hlo").as_hlo_text())
    lowerable = fn if hasattr(fn, "lower") else jax.jit(fn)
    compiled = lowerable.lower(*args, **kwargs).compile()
    return collectives_in_hlo(compiled.as_text())
