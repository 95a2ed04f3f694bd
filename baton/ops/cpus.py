"""How engines on one host share its cores: threads per engine, disjoint CPU lists, `--cpus`."""

from __future__ import annotations

import os


def engine_threads(num_engines: int) -> int:
    """Each engine's share of the cores, so two engines on two cores do not fight."""
    return max(1, (os.cpu_count() or 1) // max(1, num_engines))


def cpu_shares(num_engines: int, threads: int) -> list[str]:
    """Disjoint CPU lists (`--cpus` values), one per engine, or [] when they do not fit.

    Unpinned, the kernel moves a prefilling engine's thread onto the core a decoding engine was
    using, and the decode stalls for a time slice: exactly the interference disaggregation is
    meant to remove. One engine alone gains nothing from pinning."""
    cpus = sorted(os.sched_getaffinity(0))
    if num_engines < 2 or num_engines * threads > len(cpus):
        return []
    return [",".join(map(str, cpus[i * threads:(i + 1) * threads])) for i in range(num_engines)]


def parse_cpus(spec: str) -> set[int]:
    """A `--cpus` value as cpu_shares writes it (`0`, `2-3`, `0,2-3`) -> a CPU set; ValueError
    naming the spec otherwise."""
    cpus: set[int] = set()
    try:
        for part in filter(None, spec.split(",")):
            lo, _, hi = part.partition("-")
            cpus.update(range(int(lo), int(hi or lo) + 1))
    except ValueError:
        raise ValueError(f"--cpus {spec!r}: expected CPU numbers and ranges like 0,2-3") from None
    if not cpus or min(cpus) < 0:
        raise ValueError(f"--cpus {spec!r}: expected CPU numbers and ranges like 0,2-3")
    return cpus
