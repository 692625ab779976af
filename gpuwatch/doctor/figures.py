"""What the printed numbers mean: sentinels removed, missing figures derived.

:class:`OomFacts` keeps the text as printed; :func:`read_figures` turns it into the
figures a diagnosis can trust, and says in ``notes`` every time it set a printed value
aside or derived one:

* 2**64 bytes (``17179869184.00 GiB``) is NVML's / the allocator's "not available" or
  "no limit", and ``this process has 0 bytes`` next to gigabytes allocated is NVML
  failing to attribute memory: both become ``None``.
* A figure about a device's memory over 2 TiB (CuPy's "allocated so far: 7,250,273,780,736
  bytes") is more than any accelerator has: a running total or a corrupt value, set
  aside with a note. System RAM (``host``) is not bounded so.
* A request of 1 EiB or more is no memory anyone has: a corrupt (negative or
  overflowed) size, a bug. It is set aside rather than compared with the card.
* The pre-2.1 wording has no "reserved but unallocated": it is reserved - allocated.
* A ``Process N`` entry whose size matches PyTorch's own reserve (plus a CUDA context)
  while "this process" is missing is most likely this very process seen under its
  host PID (containers run in their own PID namespace), not a neighbour. So is one that
  the card could not hold beside this process: where the listed processes plus PyTorch's
  own reserve come to more than the card had in use (total - free), the list must
  include this process, whatever its memory outside PyTorch (CUDA graphs, NCCL, an
  engine's workspaces).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gpuwatch.doctor.facts import OomFacts, ProcessUse
from gpuwatch.doctor.units import ABSURD_REQUEST_BYTES, GIB, MIB, NOT_AVAILABLE_BYTES, format_size

# A CUDA context plus cuBLAS/cuDNN handles costs roughly 0.3-1 GiB outside PyTorch's
# allocator; used when "this process" must be estimated from PyTorch's reserve.
CONTEXT_ALLOWANCE_BYTES = 512 * MIB
# How much more than PyTorch's reserve a listed process may use and still be us.
SELF_MATCH_SLACK_BYTES = 2 * GIB
# How far the listed processes plus PyTorch's reserve may exceed what the card had in use
# (total - free) before the list must hold this process: the figures are read at slightly
# different moments, and sizes are printed rounded.
IN_USE_TOLERANCE_BYTES = 256 * MIB
# Two listed processes whose sizes differ by no more than this are equally likely to be
# this process (sizes are printed to 10 MiB, and read at slightly different moments).
SELF_TIE_BYTES = 64 * MIB
# How far what the card had in use beyond this process (total - free - ours) may exceed the
# processes listed before the rest is memory nobody listed: NVML lists only the processes
# it can attribute (not another VM's or container's, nor a dead process's memory the driver
# has not released yet), and the figures are read at slightly different moments.
UNLISTED_MIN_BYTES = 512 * MIB
UNLISTED_MIN_SHARE = 0.02
# More memory than any one accelerator has (the largest hold a few hundred GiB, unified
# memory included): a figure over it is a running total or a corrupt value.
MAX_DEVICE_BYTES = 2048 * GIB
# PyTorch's cudaMallocAsync backend: its message prints what this process's tensors hold
# ("Currently allocated"), and nothing of what its pool caches.
ASYNC_CATEGORY = "pytorch_cudamallocasync_oom"


@dataclass
class Figures:
    """Trusted figures for one message, in bytes (``None``: not known)."""

    requested: int | None
    total: int | None  # the card, or the cap the message names when it has no total
    free: int | None
    this_process: int | None  # all memory of the failing process (NVML), if known
    allocated: int | None
    reserved_unallocated: int | None
    reserved: int | None
    limit: int | None  # a per-process cap (memory fraction, MPS watermark) if printed
    others: list[ProcessUse] = field(default_factory=list)  # neighbours, self removed
    self_pid: int | None = None  # the listed PID judged to be this process
    # Listed PIDs as likely to be this process as ``self_pid`` (the same size): one of them
    # is, so none is a neighbour to stop. Includes ``self_pid`` when set.
    self_candidates: frozenset[int] = frozenset()
    others_bytes: int | None = None  # memory held by everything but this process
    others_estimated: bool = False  # True: total - free - ours, not a process list
    notes: list[str] = field(default_factory=list)

    @property
    def shortfall(self) -> int | None:
        """Bytes the request lacked: requested - free (0 when free was enough)."""
        if self.requested is None or self.free is None:
            return None
        return max(0, self.requested - self.free)

    @property
    def starved(self) -> bool:
        """Free memory was below the request, or under 5 % of the card."""
        if self.free is None:
            return True
        if self.requested is not None and self.free < self.requested:
            return True
        return self.total is not None and self.free <= 0.05 * self.total


def _real(value: int | None, what: str, notes: list[str]) -> int | None:
    if value is not None and value >= NOT_AVAILABLE_BYTES:
        notes.append(f"{what} printed as {format_size(value)} (2^64 bytes): not available, ignored")
        return None
    return value


def _on_a_device(
    value: int | None, what: str, notes: list[str], device_type: str | None
) -> int | None:
    """``value`` unless it is more memory than any one accelerator has (a counter that is
    not memory in use, or a corrupt figure); system RAM (``host``) can be that large."""
    value = _real(value, what, notes)
    if value is not None and value > MAX_DEVICE_BYTES and device_type not in ("host", "cpu"):
        notes.append(
            f"{what} printed as {format_size(value)}, more than any one accelerator holds "
            f"(over {format_size(MAX_DEVICE_BYTES)}): not memory in use (a running total or a "
            "corrupt figure), ignored"
        )
        return None
    return value


def _requested(value: int | None, notes: list[str]) -> int | None:
    if value is not None and value >= ABSURD_REQUEST_BYTES:
        notes.append(
            f"the request of {format_size(value)} is over 1 EiB: a corrupt (negative or "
            "overflowed) size, a bug in the shape, not a memory shortage; ignored"
        )
        return None
    return value


def read_figures(facts: OomFacts) -> Figures:
    """Trusted figures from ``facts``, with a note for every value set aside or derived."""
    notes: list[str] = []
    device = facts.device_type
    allocated = _on_a_device(facts.allocated_bytes, "allocated", notes, device)
    this_process = _on_a_device(facts.process_in_use_bytes, "this process's memory", notes, device)
    if this_process == 0 and allocated:
        notes.append(
            "NVML reported 0 bytes for this process next to PyTorch's allocations: ignored"
        )
        this_process = None
    limit = _real(facts.allowed_bytes, "the allowed limit", notes)
    unallocated = _on_a_device(
        facts.reserved_unallocated_bytes, "reserved but unallocated", notes, device
    )
    reserved = _on_a_device(facts.reserved_bytes, "reserved", notes, device)
    if unallocated is None and reserved is not None and allocated is not None:
        unallocated = max(0, reserved - allocated)
        notes.append(
            "reserved but unallocated = reserved in total - allocated (the parenthesised wording)"
        )
    if reserved is None and unallocated is not None and allocated is not None:
        reserved = allocated + unallocated
    figures = Figures(
        requested=_requested(facts.requested_bytes, notes),
        total=_on_a_device(facts.total_bytes, "total", notes, device),
        free=_on_a_device(facts.free_bytes, "free", notes, device),
        this_process=this_process,
        allocated=allocated,
        reserved_unallocated=unallocated,
        reserved=reserved,
        limit=limit,
        notes=notes,
    )
    _split_self(facts, figures)
    _estimate_others(facts, figures)
    _async_note(facts, figures)
    _sanity_notes(figures)
    return figures


def _split_self(facts: OomFacts, figures: Figures) -> None:
    figures.others = list(facts.other_processes)
    reserved = figures.reserved
    if figures.this_process is not None or reserved is None or not figures.others:
        return
    listed = sum(p.used_bytes for p in figures.others)
    in_use = _in_use(figures)
    # Were this process not listed, the card would hold the listed processes and, apart
    # from them, at least PyTorch's reserve: more than it had in use means it is listed.
    listed_holds_us = in_use is not None and listed + reserved > in_use + IN_USE_TOLERANCE_BYTES
    # Only a listed process that holds at least PyTorch's reserve can be this process.
    fits = [p for p in figures.others if p.used_bytes >= reserved]
    if not listed_holds_us:
        fits = [p for p in fits if p.used_bytes <= reserved + SELF_MATCH_SLACK_BYTES]
    if not fits:
        return
    # The least memory outside PyTorch is the likeliest: a neighbour's size is anything.
    me = min(fits, key=lambda p: p.used_bytes - reserved)
    tied = [p for p in fits if abs(p.used_bytes - me.used_bytes) <= SELF_TIE_BYTES]
    figures.self_pid = me.pid
    figures.self_candidates = frozenset(p.pid for p in tied)
    figures.this_process = me.used_bytes
    figures.others = [p for p in figures.others if p is not me]
    if len(tied) > 1:
        pids = " or ".join(f"Process {p.pid}" for p in tied)
        figures.notes.append(
            f"{pids} ({format_size(me.used_bytes)} each) is most likely this process under its "
            "host PID (a container has its own PID namespace), and their sizes cannot tell "
            "which: check which is yours (nvidia-smi on the host, ps -o pid,user,cmd -p PID) "
            "before stopping the other"
        )
        return
    if listed_holds_us:
        why = (
            f"the processes listed ({format_size(listed)}) plus PyTorch's own "
            f"{format_size(reserved)} come to more than the card had in use "
            f"({format_size(in_use or 0)}, total - free), so the list includes this process"
        )
    else:
        why = f"it matches PyTorch's own {format_size(reserved)} plus a CUDA context"
    figures.notes.append(
        f"Process {me.pid} ({format_size(me.used_bytes)}) is most likely this process under "
        f"its host PID (a container has its own PID namespace), not a neighbour: {why}"
    )


def _in_use(figures: Figures) -> int | None:
    """What the card had in use, total - free, where both are printed and make sense."""
    if figures.total is None or figures.free is None or figures.free > figures.total:
        return None  # an APU's "free" is not a share of this total
    return figures.total - figures.free


def _estimate_others(facts: OomFacts, figures: Figures) -> None:
    beyond_us = _in_use_beyond_us(figures, async_backend=facts.category == ASYNC_CATEGORY)
    if not facts.other_processes:
        if beyond_us is not None:
            # Pre-2.1 wordings and ROCm (no process list): what the card has in use
            # beyond this process belongs to someone else.
            figures.others_bytes = beyond_us
            figures.others_estimated = True
        return
    listed = sum(p.used_bytes for p in figures.others)
    figures.others_bytes = listed
    if beyond_us is None or figures.total is None:
        return
    unlisted = beyond_us - listed
    if unlisted <= max(UNLISTED_MIN_BYTES, UNLISTED_MIN_SHARE * figures.total):
        return
    # A list that falls short of what the card had in use: the rest is held all the same,
    # by processes NVML could not list, and must not make the others' share look smaller.
    figures.others_bytes = beyond_us
    figures.others_estimated = True
    figures.notes.append(
        f"{format_size(unlisted)} of the card is held by processes the message does not list "
        f"(total - free - this process - the {format_size(listed)} listed): another container "
        "or VM on the same GPU, or the memory of a process that died and that the driver has "
        "not released yet"
    )


def _in_use_beyond_us(figures: Figures, *, async_backend: bool = False) -> int | None:
    """total - free - this process (or PyTorch's reserve and a context), where known. The
    async backend prints no reserve: its tensors (a lower bound of this process) stand in,
    and what is beyond them may be its own pool (:func:`_async_note`)."""
    ours = figures.this_process
    if ours is None and figures.reserved is not None:
        ours = figures.reserved + CONTEXT_ALLOWANCE_BYTES
    if ours is None and async_backend and figures.allocated is not None:
        ours = figures.allocated + CONTEXT_ALLOWANCE_BYTES
    in_use = _in_use(figures)
    if in_use is None or ours is None:
        return None  # an APU's shared memory: "free" is not a share of this total
    return max(0, in_use - ours)


def _async_note(facts: OomFacts, figures: Figures) -> None:
    """Say what the async backend's estimate of others' memory may really be."""
    if facts.category != ASYNC_CATEGORY or not figures.others_estimated:
        return
    if figures.others_bytes is None or figures.allocated is None:
        return
    figures.notes.append(
        f"cudaMallocAsync prints only what this process's tensors hold "
        f"({format_size(figures.allocated)}); the other {format_size(figures.others_bytes)} "
        "in use (total - free - those tensors - a CUDA context) is held by other processes or "
        "by this process's async pool (freed blocks it caches, and fragmentation): the message "
        "cannot tell which"
    )


def _sanity_notes(figures: Figures) -> None:
    total, free, requested = figures.total, figures.free, figures.requested
    if total is not None and free is not None and free > total:
        figures.notes.append(
            f"free ({format_size(free)}) exceeds total ({format_size(total)}): an APU or "
            "unified-memory device, where total is not the whole pool"
        )
    if total is not None and figures.allocated is not None and figures.allocated > total:
        figures.notes.append(
            "PyTorch has more allocated than the card holds: Windows WDDM spilling into "
            "system memory (slow), or a stale reading"
        )
    limit, reserved = figures.limit, figures.reserved
    if limit is not None and total is not None and limit < total and reserved is not None:
        figures.notes.append(
            f"a per-process limit of {format_size(limit)} is set (set_per_process_memory_fraction); "
            f"PyTorch had reserved {format_size(reserved)} of it"
        )
    capped = (
        limit is not None and reserved is not None and requested is not None
        and reserved + requested > limit
    )  # fmt: skip
    if capped:
        return  # the cap refused it (diagnosis._memory_fraction), not anything about free
    if requested is not None and free is not None and free >= requested and free <= (total or free):
        figures.notes.append(
            f"free ({format_size(free)}) was at least the request ({format_size(requested)}) "
            "and it still failed: a per-allocation or per-process limit, a stale reading, or "
            "free memory split into pieces too small for one block"
        )
