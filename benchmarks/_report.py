"""What every benchmark's results file records about the machine it ran on."""

import importlib.metadata
import os
import pathlib
import platform


def cpu_model() -> str:
    """The CPU's model name from /proc/cpuinfo, or what `platform` knows."""
    try:
        for line in pathlib.Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def versions(*packages: str) -> str:
    """`name version` for each installed package, then Python's version."""
    listed = ", ".join(
        f"{name} {importlib.metadata.version(name)}" for name in packages
    )
    return f"{listed}, python {platform.python_version()}"


def machine_line() -> str:
    return f"- nproc: {len(os.sched_getaffinity(0))}; CPU: {cpu_model()}"


def load_line(load_at_start: tuple[float, ...]) -> str:
    """The load average when the run started and now: how noisy its timings are."""
    return (
        "- load average (1, 5, 15 min) at start / end: "
        + ", ".join(f"{x:.2f}" for x in load_at_start)
        + " / "
        + ", ".join(f"{x:.2f}" for x in os.getloadavg())
    )
