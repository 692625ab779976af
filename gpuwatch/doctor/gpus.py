"""GPU memory sizes for ``gpuwatch fit --gpu``: a catalogue, a plain size, or this host.

Catalogue sizes are the nominal memory (an "80GB" H100 has 80 GiB of HBM). The usable
total a driver reports is a little lower (an H100 80GB shows 81,559 MiB = 79.6 GiB in
``nvidia-smi``), which the 10-15 % headroom the verdict asks for covers.

A size's GB means GiB, as GPU memory is sold: an RTX 4090's "24 GB" is 24 GiB (24,564
MiB in ``nvidia-smi``), so ``--gpu 24GB`` is that card, not 22.4 GiB. (Scenario files,
:mod:`gpuwatch.quantities`, read GB as 10**9 bytes, as a vendor's decimal spec sheet.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuwatch.doctor.units import ABSURD_REQUEST_BYTES, GIB, size_to_bytes
from gpuwatch.errors import ConfigError
from gpuwatch.snapshot import HostSnapshot

CATALOGUE_GIB: dict[str, int] = {
    "T4": 16,
    "V100-16GB": 16,
    "RTX4080": 16,
    "A10G": 24,
    "L4": 24,
    "RTX3090": 24,
    "RTX4090": 24,
    "V100-32GB": 32,
    "RTX5090": 32,
    "A100-40GB": 40,
    "L40S": 48,
    "A6000": 48,
    "A100-80GB": 80,
    "H100-80GB": 80,
    "H200": 141,
    "B200": 180,
}


@dataclass(frozen=True)
class GpuTarget:
    """One GPU to fit on: its name, total memory and (for this host) free memory now."""

    name: str
    total_bytes: int
    free_bytes: int | None = None


def _canonical(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


_BY_CANONICAL = {_canonical(name): name for name in CATALOGUE_GIB}
# "24GiB", "24 GB", "24gb", "0.5T": binary multiples whatever the spelling (module doc).
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTPE](?:iB|B)?)\s*", re.IGNORECASE)


def catalogue_target(name: str) -> GpuTarget:
    """A catalogue GPU (``"h100-80gb"``, ``"RTX 4090"``) or a size (``"24GiB"``).

    Raises ``ConfigError`` for anything else, listing the known names.
    """
    known = _BY_CANONICAL.get(_canonical(name))
    if known is not None:
        return GpuTarget(known, CATALOGUE_GIB[known] * GIB)
    match = _SIZE.fullmatch(name)
    if match is None:
        choices = ", ".join(CATALOGUE_GIB)
        raise ConfigError(
            f"--gpu: unknown GPU {name!r}; use a size like 24GiB (GB means GiB), 'local', "
            f"or one of {choices}"
        )
    size = size_to_bytes(match[1], match[2])
    if size <= 0:
        raise ConfigError("--gpu: size must be positive")
    if size >= ABSURD_REQUEST_BYTES:
        raise ConfigError(f"--gpu: {name!r} is more memory than any device has (1 EiB or more)")
    return GpuTarget(name, size)


def local_targets(snapshot: HostSnapshot) -> list[GpuTarget]:
    """This host's GPUs as the agent sees them (lost GPUs and unknown sizes skipped)."""
    return [
        GpuTarget(
            f"GPU {gpu.index} ({gpu.name or 'unknown'})",
            gpu.memory_total_bytes,
            gpu.memory_free_bytes,
        )
        for gpu in snapshot.gpus
        if not gpu.lost and gpu.memory_total_bytes
    ]


def smallest_fitting(needed_bytes: int, *, headroom: float, larger_than: int = 0) -> str | None:
    """The smallest catalogue GPU that holds ``needed_bytes`` with ``headroom`` to spare.

    Only cards with more than ``larger_than`` bytes count: "a bigger GPU" that is the
    card asked about, or one of the same size, is no advice.
    """
    for name, gib in sorted(CATALOGUE_GIB.items(), key=lambda item: item[1]):
        if gib * GIB > larger_than and needed_bytes <= (1 - headroom) * gib * GIB:
            return name
    return None
