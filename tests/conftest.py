import os
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings


# Importing the test helpers here would import quax_tangents, and with it start JAX's
# backend before the flags below are set: the flag is spelled out, as in
# `tests/helpers/collective.py`.
_DEVICE_FLAG = "--xla_force_host_platform_device_count=8"


def _with_flag(flags: str, name: str, flag: str) -> str:
    """`flags` with `flag` added, unless `flags` already names `name`."""
    return flags if name in flags else " ".join(filter(None, [flags, flag]))


# XLA's CPU backend runs LLVM at -O2 on every program it compiles. The suite's
# programs are tiny, so compiling them costs more than running them, and at -O0 LLVM
# compiles them several times faster (one scanned gradient of
# `tests/marks/test_cotangents_stacked.py`: 6.6 s at -O2, 1.2 s at -O0). XLA's own
# passes do not depend on it: the optimised HLO, `memory_analysis()` and
# `cost_analysis()` are the same; float results may differ in their last bits (the
# tests compare within tolerances, or variants compiled alike).
#
# The multi-device tests (shard_map, collectives, tensor parallelism) need 8 devices,
# which XLA's CPU backend gives as host devices when asked before it starts. With them
# in every worker those tests run beside the others, not in fresh processes of their
# own; a one-device program still runs on the first device, as it would alone.
#
# Both are set before JAX starts its backend; subprocesses (examples and benchmarks)
# inherit the level, while `tests/helpers/scripts.py` leaves the device count to the
# scripts. An XLA_FLAGS that names a level or a count already keeps it.
_flags = os.environ.get("XLA_FLAGS", "")
_flags = _with_flag(
    _flags, "xla_backend_optimization_level", "--xla_backend_optimization_level=0"
)
_flags = _with_flag(_flags, "xla_force_host_platform_device_count", _DEVICE_FLAG)
os.environ["XLA_FLAGS"] = _flags


# Many tests compile a program that another test (or another hypothesis example)
# compiled already, from a fresh function: a step rebuilt per test, a closure per
# example. JAX's in-memory cache is keyed by the function and misses them; its
# persistent cache is keyed by the program and the compiler's options, and shared
# between processes. One directory per run, made by the process that starts pytest
# and inherited (as environment) by its xdist workers and subprocesses; removed when
# that process ends. On 2 cores, the tests not marked `slow`: 1,023 s without it, 919 s
# with it (one run each, the same hour); `tests/marks`: 157 and 168 s without, 118 and
# 125 s with (`tests/types`, whose programs are mostly distinct: 99 against 105 s).
# A JAX_COMPILATION_CACHE_DIR already set is left as it is, and not removed.
_CACHE_VARIABLE = "JAX_COMPILATION_CACHE_DIR"
_own_cache_dir = None
if _CACHE_VARIABLE not in os.environ:
    _own_cache_dir = tempfile.mkdtemp(prefix="quax_tangents-tests-xla-cache-")
    os.environ[_CACHE_VARIABLE] = _own_cache_dir
    # Every program, however quick to compile: most of the suite's are.
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    # A pytest plugin may have imported JAX already (it reads the variables when
    # imported); its backend, and so the cache, starts at the first compile.
    import jax

    jax.config.update("jax_compilation_cache_dir", _own_cache_dir)
    jax.config.update(
        "jax_persistent_cache_min_compile_time_secs",
        float(os.environ["JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS"]),
    )


def pytest_unconfigure(config):
    if _own_cache_dir is not None:
        shutil.rmtree(_own_cache_dir, ignore_errors=True)


# Property tests compile a small JAX program per example; on 2 cores that dominates
# the suite, so the example counts are chosen per profile.
settings.register_profile(
    "default",
    max_examples=10,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "ci",
    max_examples=10,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=True,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.register_profile(
    "thorough",
    max_examples=200,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))


@pytest.fixture
def scans_projected(monkeypatch):
    """How many scans took the layer-by-layer path."""
    from quax_tangents._marks import _marked_scan

    calls = []
    original = _marked_scan.scan_with_projected_xs

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(_marked_scan, "scan_with_projected_xs", counted)
    return calls


@pytest.fixture(autouse=True)
def _fresh_fallback_counts():
    """Each test starts with no densification counted and nothing warned yet: the
    warn-once memory is per process, so without this a test's warnings would depend
    on which tests ran before it in the same worker."""
    import quax_tangents as qt

    qt.reset_fallback_counts()
