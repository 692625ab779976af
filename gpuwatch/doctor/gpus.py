"""GPU memory sizes for ``gpuwatch fit --gpu``: a catalogue, a plain size, or this host.

Catalogue sizes are what the driver reports as the total (``nvidia-smi``'s
``memory.total``), in MiB, where that is known: ECC and reserved memory take a few
per cent off the nominal size on some cards (an "80GB" H100 shows 81,559 MiB = 79.6
GiB, a 16 GB T4 15,360 MiB = 15 GiB, an L40S 46,068 MiB = 45.0 GiB), and that would
otherwise eat most of the 10-15 % "tight" band. The cards marked nominal below are
their sold size (GiB x 1024) until a driver total is confirmed for them.

A size's GB means GiB, as GPU memory is sold: an RTX 4090's "24 GB" is 24 GiB (its
driver reports 24,564 MiB, 12 MiB less), so ``--gpu 24GB`` is that card, not 22.4 GiB. (Scenario files,
:mod:`gpuwatch.quantities`, read GB as 10**9 bytes, as a vendor's decimal spec sheet.)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from gpuwatch.doctor.units import ABSURD_REQUEST_BYTES, MIB, size_to_bytes
from gpuwatch.errors import ConfigError
from gpuwatch.snapshot import HostSnapshot, MigInstance

# MiB: the driver's total (nvidia-smi memory.total) where noted, else the nominal size.
CATALOGUE_MIB: dict[str, int] = {
    "T4": 15_360,  # driver total (ECC on)
    "V100-16GB": 16 * 1024,  # nominal
    "RTX4080": 16 * 1024,  # nominal
    "A10G": 23_028,  # driver total
    "L4": 23_034,  # driver total
    "RTX3090": 24 * 1024,  # nominal
    "RTX4090": 24_564,  # driver total
    "V100-32GB": 32 * 1024,  # nominal
    "RTX5090": 32 * 1024,  # nominal
    "A100-40GB": 40_960,  # driver total (= 40 GiB)
    "L40S": 46_068,  # driver total
    "A6000": 48 * 1024,  # nominal
    "A100-80GB": 81_920,  # driver total (= 80 GiB)
    "H100-80GB": 81_559,  # driver total
    "H100-NVL": 95_830,  # driver total (sold as 94 GB)
    "H200": 143_771,  # driver total
    "B200": 180 * 1024,  # nominal
}
# Cards without bf16 arithmetic (before Ampere): no use as "a bigger GPU" for bf16.
NO_BF16 = frozenset({"T4", "V100-16GB", "V100-32GB"})
# Other spellings of a catalogue card.
ALIASES = {"H10094GB": "H100-NVL", "H100NVL94GB": "H100-NVL", "H10080GBHBM3": "H100-80GB"}
# A bare family name is several cards: refused with the variants rather than guessed.
AMBIGUOUS = {
    "H100": ("H100-80GB", "H100-NVL"),
    "A100": ("A100-40GB", "A100-80GB"),
    "V100": ("V100-16GB", "V100-32GB"),
}
# MIG profiles, MiB: the driver's total for the instance (nvidia-smi mig -lgip, GiB x
# 1024), the smallest any card gives that profile name (an A100-80GB's 1g.10gb has
# 9.50 GiB, an H100's a little more). A MIG instance is never the whole card.
MIG_PROFILES_MIB: dict[str, int] = {
    # A100-40GB
    "1g.5gb": 4_864,
    "2g.10gb": 9_984,
    "3g.20gb": 20_090,
    "4g.20gb": 20_090,
    "7g.40gb": 40_448,
    # A100-80GB, H100-80GB
    "1g.10gb": 9_728,
    "1g.20gb": 19_968,
    "2g.20gb": 19_968,
    "3g.40gb": 40_192,
    "4g.40gb": 40_192,
    "7g.80gb": 81_152,
}
_MIG_NAME = re.compile(r"\s*(?:MIG[\s-]*)?(\d+g\.\d+gb)\s*", re.IGNORECASE)


@dataclass(frozen=True)
class GpuTarget:
    """One GPU to fit on: its name, total memory and (for this host) free memory now."""

    name: str
    total_bytes: int
    free_bytes: int | None = None
    # This host's GPUs of the same size, this one included (what it can split over);
    # 1 for a MIG instance, which is never split over.
    peers: int = 1
    local: bool = False
    # The MIG profile (``3g.40gb``) of a MIG instance; None for a whole card.
    mig_profile: str | None = None


def _canonical(name: str) -> str:
    return re.sub(r"[^A-Z0-9]", "", name.upper())


_BY_CANONICAL = {_canonical(name): name for name in CATALOGUE_MIB}
# "24GiB", "24 GB", "24gb", "0.5T": binary multiples whatever the spelling (module doc).
_SIZE = re.compile(r"\s*(\d+(?:\.\d+)?)\s*([KMGTPE](?:iB|B)?)\s*", re.IGNORECASE)


def catalogue_target(name: str) -> GpuTarget:
    """A catalogue GPU (``"h100-80gb"``, ``"RTX 4090"``) or a size (``"24GiB"``).

    Raises ``ConfigError`` for anything else, listing the known names.
    """
    canonical = _canonical(name)
    known = _BY_CANONICAL.get(canonical) or ALIASES.get(canonical)
    if known is not None:
        return GpuTarget(known, CATALOGUE_MIB[known] * MIB)
    if canonical in AMBIGUOUS:
        raise ConfigError(
            f"--gpu: {name!r} is several cards; name one: {', '.join(AMBIGUOUS[canonical])}"
        )
    mig = _MIG_NAME.fullmatch(name)
    if mig is not None and mig[1].lower() in MIG_PROFILES_MIB:
        profile = mig[1].lower()
        return GpuTarget(f"MIG {profile}", MIG_PROFILES_MIB[profile] * MIB, mig_profile=profile)
    match = _SIZE.fullmatch(name)
    if match is None:
        choices = ", ".join(CATALOGUE_MIB)
        raise ConfigError(
            f"--gpu: unknown GPU {name!r}; use a size like 24GiB (GB means GiB), 'local', "
            f"a MIG profile such as 1g.10gb, or one of {choices}"
        )
    size = size_to_bytes(match[1], match[2])
    if size <= 0:
        raise ConfigError("--gpu: size must be positive")
    if size >= ABSURD_REQUEST_BYTES:
        raise ConfigError(f"--gpu: {name!r} is more memory than any device has (1 EiB or more)")
    return GpuTarget(name, size)


def local_targets(snapshot: HostSnapshot) -> list[GpuTarget]:
    """This host's GPUs as the agent sees them (lost GPUs and unknown sizes skipped).

    A GPU split into MIG instances is one target per instance, with the instance's
    memory: a process gets one instance, never the whole card.
    """
    targets: list[GpuTarget] = []
    whole = [
        gpu.memory_total_bytes
        for gpu in snapshot.gpus
        if not gpu.lost and not gpu.mig_instances and gpu.memory_total_bytes
    ]
    for gpu in snapshot.gpus:
        if gpu.lost:
            continue
        if gpu.mig_instances:
            targets += [
                _mig_target(gpu.index, mig) for mig in gpu.mig_instances if mig.memory_total_bytes
            ]
        elif gpu.memory_total_bytes:
            name = f"GPU {gpu.index} ({gpu.name or 'unknown'})"
            peers = whole.count(gpu.memory_total_bytes)
            targets.append(
                GpuTarget(
                    name, gpu.memory_total_bytes, gpu.memory_free_bytes, peers=peers, local=True
                )
            )
    return targets


def _mig_target(gpu_index: int, mig: MigInstance) -> GpuTarget:
    """``GPU 0 MIG 1g.10gb (instance 7)``: the profile, and NVML's GPU instance id (the
    MIG device index when the id is unknown)."""
    profile = mig.profile or mig.name or "instance"
    which = (
        f"instance {mig.gpu_instance_id}"
        if mig.gpu_instance_id is not None
        else f"MIG device {mig.index}"
    )
    total = mig.memory_total_bytes or 0
    used = mig.memory_used_bytes
    free = None if used is None else max(0, total - used)
    known = profile.lower() if profile.lower() in MIG_PROFILES_MIB else None
    name = f"GPU {gpu_index} MIG {profile} ({which})"
    return GpuTarget(name, total, free, local=True, mig_profile=known or profile)


def larger_mig_profile(needed_bytes: int, *, headroom: float, profile: str) -> str | None:
    """The smallest MIG profile of ``profile``'s card larger than it that holds
    ``needed_bytes`` with ``headroom``: for a MIG instance the advice is a larger slice
    of the same card, not another card. ``None`` for an unknown profile or none fits."""
    current = MIG_PROFILES_MIB.get(profile.lower())
    if current is None:
        return None
    # The card's family by the profile's memory unit: a 1g slice of 5 GB or of 10 GB.
    family = _mig_family(profile.lower())
    for name, mib in sorted(MIG_PROFILES_MIB.items(), key=lambda item: item[1]):
        if _mig_family(name) != family or mib <= current:
            continue
        if needed_bytes <= (1 - headroom) * mib * MIB:
            return name
    return None


def _mig_family(profile: str) -> str:
    """``"40gb"`` for an A100-40GB's profiles, ``"80gb"`` for an 80 GB card's."""
    return "40gb" if profile in _MIG_40GB else "80gb"


_MIG_40GB = frozenset({"1g.5gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"})


def smallest_fitting(
    needed_bytes: int, *, headroom: float, larger_than: int = 0, dtype: str | None = None
) -> str | None:
    """The smallest catalogue GPU that holds ``needed_bytes`` with ``headroom`` to spare.

    Only cards with more than ``larger_than`` bytes count: "a bigger GPU" that is the
    card asked about, or one of the same size, is no advice; nor is one that cannot
    compute in ``dtype`` (bf16 on a V100 or T4).
    """
    for name, mib in sorted(CATALOGUE_MIB.items(), key=lambda item: item[1]):
        if dtype == "bf16" and name in NO_BF16:
            continue
        if mib * MIB > larger_than and needed_bytes <= (1 - headroom) * mib * MIB:
            return name
    return None
