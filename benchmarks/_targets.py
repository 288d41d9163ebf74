"""The compile targets the benchmarks share: this machine's CPU, or a TPU generation
compiled ahead of time with no TPU attached (`jax.experimental.topologies`, whose
compiler comes with `pip install "jax[tpu]"`; keep it out of the test environment).

Importing this module imports no JAX, so a benchmark can set `XLA_FLAGS` after it.
"""

# Per target, the topology of one chip and of its 8-chip slice (None: this machine).
TARGETS = {
    "cpu": None,
    "tpu-v5e": ("v5e:2x2", "v5e:2x4"),
    "tpu-v5p": ("v5p:2x2x1", "v5p:2x2x2"),
    "tpu-v6e": ("v6e:2x2", "v6e:2x4"),
}


def target_devices(target: str, devices: int = 1) -> list:
    """The devices to compile for: this machine's, or those of a TPU topology, one
    chip's (`devices=1`) or the 8-chip slice's."""
    if target not in TARGETS:
        raise ValueError(f"`target` must be one of {sorted(TARGETS)}, not {target!r}")
    import jax
    from jax.experimental import topologies

    topology = TARGETS[target]
    if topology is None:
        return jax.devices()

    single, sliced = topology
    name = single if devices == 1 else sliced
    return list(
        topologies.get_topology_desc(platform="tpu", topology_name=name).devices
    )


def one_device(device):
    """The sharding that puts an array whole on `device`: JAX 0.12.1 deprecates
    constructing `jax.sharding.SingleDeviceSharding` for
    `jax.sharding.make_single_device_sharding`, which older JAX lacks."""
    import jax

    make = getattr(jax.sharding, "make_single_device_sharding", None)
    return jax.sharding.SingleDeviceSharding(device) if make is None else make(device)


def is_tpu_target(argv: list[str]) -> bool:
    """Whether a command line asks for a TPU target (`--target tpu-...`), read before
    JAX starts: a TPU target keeps the TPU compiler's defaults, not the CPU flags
    a benchmark sets."""
    return any(
        a.startswith("--target=tpu") or (a == "--target" and v.startswith("tpu"))
        for a, v in zip(argv, argv[1:] + [""])
    )
