"""Host RAM, not the GPU: PyTorch's CPU allocator refusing, or a worker killed with SIGKILL.

PyTorch's CPU allocator says so itself: ``DefaultCPUAllocator: can't allocate memory:
you tried to allocate N bytes. Error code 12 (Cannot allocate memory)`` (Linux), ``...
not enough memory: you tried to allocate N bytes.`` (Windows), and the legacy TH's ``$
Torch: not enough memory: you tried to allocate 3GB. Buy new RAM!``. The tensor was on
the CPU (a model loaded there first, a batch collated there), so the fix is system RAM.

``torchrun`` (torch.distributed.elastic) reports a worker that died of signal 9 as
``failed (exitcode: -9) local_rank: 0 (pid: 1322)`` and, in its summary, ``exitcode : -9``
with ``Signal 9 (SIGKILL) received by PID 14750``. People read it as a GPU
out-of-memory; on Linux it is nearly always the kernel's OOM killer reclaiming system
RAM (data-loader workers, a model loaded on the CPU first), though a scheduler's kill
(Slurm's time or memory limit) looks the same. A GPU OOM raises an exception instead.

Applications that say system RAM ran out in their own words (:func:`find_applications`):

* Ollama refuses to load a model that would not fit in system RAM: ``model requires more
  system memory (3.7 GiB) than is available (3.6 GiB)`` (the request and what was free),
  also without the sizes (``... than is currently available``).
* Unity's memory manager: ``Could not allocate memory: System out of memory!``, with
  ``Trying to allocate: 67108864B with 16 alignment`` after it, and its allocators'
  ``DynamicHeapAllocator out of memory - Could not get memory for large allocation N!``.
* Unreal Engine's ``Ran out of memory allocating 5894144 (5.6 MiB) bytes with alignment 0``,
  often with Windows' ``The paging file is too small for this operation to complete``.
* LMCache's buffer for KV-cache chunks (``memory_management.py``), a fixed pool of CPU
  memory (``max_local_cpu_size``): ``Failed to allocate memory for tensor(torch.Size([...]),
  torch.float16) because no memory is available`` (and ``... memory block of size N ...``).
  That pool, not the whole machine, is what is full.
* The Java virtual machine (Spark's executors and driver, Android apps):
  ``java.lang.OutOfMemoryError: Java heap space`` (also ``GC overhead limit exceeded``,
  ``Requested array size exceeds VM limit``, Android's ``Failed to allocate a N byte
  allocation with M free bytes``) is the heap's limit (``-Xmx``, ``spark.executor.memory``);
  ``Direct buffer memory`` and ``Metaspace`` are pools the JVM keeps outside its heap.

The Linux kernel's OOM killer, as pasted from ``dmesg`` or ``journalctl -k``
(:func:`find_oom_killer`); one kill prints several lines, each read alone too:

* ``python3 invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|__GFP_COMP), order=0,
  oom_score_adj=0`` (the process that asked for memory, not always the one killed);
* ``oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),...,task=python3,pid=25315,uid=0``;
* ``Out of memory: Killed process 25315 (python3) total-vm:48123456kB, anon-rss:30123456kB,
  ...`` (before Linux 4.19 ``Out of memory: Kill process N (name) score S or sacrifice child``
  then ``Killed process N (name) total-vm:..., anon-rss:...``). anon-rss is what the process
  held in RAM, kept as ``process_in_use_bytes``.

A memory cgroup's limit (a container's ``--memory``, a pod's ``limits.memory``, Slurm's
``--mem``) says ``Memory cgroup out of memory: Killed process ...`` and
``constraint=CONSTRAINT_MEMCG``; Kubernetes and Docker report the same kill as ``Reason:
OOMKilled`` and ``"OOMKilled": true``. Lines that set ``oom_score_adj``, or ``"OOMKilled":
false``, are not a kill.

PyTorch's DataLoader (:func:`find_dataloader`): ``DataLoader worker (pid 19597) is killed by
signal: Killed.`` is a worker SIGKILLed, most likely by the OOM killer; ``... killed by
signal: Bus error. It is possible that dataloader's workers are out of shared memory.``
(and the older ``ERROR: Unexpected bus error encountered in worker. This might be caused by
insufficient shared memory (shm).``) is /dev/shm too small for the batches the workers hand
over. A worker's segmentation fault is not memory running out.
"""

from __future__ import annotations

import re

from gpuwatch.doctor.facts import OomFacts
from gpuwatch.doctor.families.clauses import (
    Found,
    Span,
    compile_clause,
    exception_before,
    line_end,
    spans,
)
from gpuwatch.doctor.units import parse_size

_SIGKILL = re.compile(
    r"failed\s+\(exitcode:\s*-9\)|exitcode\s*:\s*-9\b|Signal\s+9\s+\(SIGKILL\)\s+received"
    # Other launchers say the same of a worker's return code: DeepSpeed's
    # "[launch.py:320:sigkill_handler] ['/usr/bin/python', ...] exits with return code = -9",
    # "... exited with exit code -9".
    r"|\bexit(?:s|ed)?\s+with\s+(?:return|exit)\s+code\s*[=:]?\s*-9\b"
)
# The CUDA toolchain out of system RAM while compiling (a flash-attention or ONNX Runtime
# build with many jobs at once): ptxas's own words, the EDG front end's (cudafe++, cicc),
# and nvcc reporting cicc or ptxas killed (by the kernel's OOM killer, signal 9).
_COMPILER = re.compile(
    r"ptxas\s+fatal\s*:\s*Memory\s+allocation\s+failure"
    r"|\bcatastrophic\s+error\s*:\s*out\s+of\s+memory"
    r"|\bnvcc\s+error\s*:\s*'(?:cicc|ptxas|cudafe\+\+)'\s+died\s+due\s+to\s+signal\s+9\b"
)
_CPU_ALLOCATOR = re.compile(
    r"DefaultCPUAllocator:\s*(?:can't\s+allocate|not\s+enough)\s+memory:\s*you\s+tried\s+to\s+allocate\s+(?P<bytes>\d+)\s+bytes"
    r"|(?P<th>Torch:\s+not\s+enough\s+memory:)"
)
_TH_SIZE = compile_clause(r"you\s+tried\s+to\s+allocate\s+")
# Each application's wording (see the module's docstring).
_SIZE = r"\d+(?:\.\d+)?\s?[KMGT]i?B"
_APPLICATIONS = re.compile(
    rf"(?P<ollama>model\s+requires\s+more\s+system\s+memory)(?:\s+\((?P<need>{_SIZE})\))?"
    rf"\s+than\s+is\s+(?:currently\s+)?available(?:\s+\((?P<free>{_SIZE})\))?"
    r"|(?P<unity>Could\s+not\s+allocate\s+memory:\s+System\s+out\s+of\s+memory)"
    # (the allocator's name is tried from a word's first character only: linear in a long word)
    r"|(?<!\w)(?P<unity_allocator>\w{1,60}Allocator)\s+out\s+of\s+memory\s+-\s+Could\s+not\s+get\s+memory"
    r"\s+for\s+large\s+allocation\s+(?P<large>\d+)"
    r"|(?P<unreal>Ran\s+out\s+of\s+memory\s+allocating)\s+(?P<unreal_bytes>\d+)\s+(?:\([^)\n]{0,40}\)\s+)?"
    r"bytes\s+with\s+alignment\s+\d+"
    # The Java virtual machine (Spark's executors and driver, Android apps): the heap, or
    # memory it keeps outside the heap (direct buffers, class metadata). Not "unable to
    # create native thread", a limit on threads.
    r"|java\.lang\.OutOfMemoryError:[ \t]*(?:(?P<jvm_heap>Java\s+heap\s+space|GC\s+overhead"
    r"\s+limit\s+exceeded|Requested\s+array\s+size\s+exceeds\s+VM\s+limit|Failed\s+to\s+allocate"
    r"\s+an?\s+(?P<jvm_bytes>\d+)[\s-]byte\s+allocation(?:\s+with\s+(?P<jvm_free>\d+)\s+free\s+bytes)?)"
    r"|(?P<jvm_off_heap>(?:Cannot\s+reserve\s+\d+\s+bytes\s+of\s+)?[Dd]irect\s+buffer\s+memory"
    r"|Metaspace|Compressed\s+class\s+space))"
    r"|(?P<lmcache>Failed\s+to\s+allocate\s+memory)\s+(?:for\s+tensor\((?P<tensor>[^\n]{0,200}?)\)"
    r"|block\s+of\s+size\s+(?P<block>\d+))\s+because\s+no\s+memory\s+is\s+available"
)
# A word of each of _APPLICATIONS' branches (clauses.mentions).
_APPLICATION_WORDS = ("requires", "memory:", "large", "alignment", "because", "outofmemoryerror")
# Unity's line after its failure: "Trying to allocate: 32768B with 16 alignment."
_UNITY_SIZE = re.compile(r"Trying\s+to\s+allocate:\s*(?P<bytes>\d+)B\b")
UNITY_SIZE_LOOKAHEAD_CHARS = 400
MAX_APPLICATION_TRIES = 16  # each costs a look along its line
# LMCache's tensor: "torch.Size([2, 80, 256, 256]), torch.float16".
_TORCH_TENSOR = re.compile(r"torch\.Size\((?P<shape>\[[\d,\s]{0,100}\])\),\s*torch\.(?P<dtype>\w+)")
_PID = re.compile(r"\(pid:\s*(?P<pid>\d+)\)|received\s+by\s+PID\s+(?P<pid2>\d+)")


# The kernel's lines (see the module's docstring); a "Killed process" without the "Out of
# memory:" before it must show the kernel's figures after it (total-vm, anon-rss).
_KERNEL = re.compile(
    r"(?P<memcg>Memory\s+cgroup\s+)?(?P<oom>[Oo]ut\s+of\s+memory(?:\s+\([\w\s]{1,40}\))?:\s+)?"
    r"Kill(?:ed)?\s+process\s+(?P<pid>\d+)\s+\((?P<name>[^()\n]{1,64})\)"
    # What the kernel prints after the name (or the paste ends there): its figures, or
    # the old "score 913 or sacrifice child".
    r"(?=[ \t]*$|,?\s+(?:total-vm|anon-rss):\d|\s+score\s+\d)"
    r"|oom-kill:constraint=(?P<constraint>CONSTRAINT_\w+)"
    r"|(?P<invoked>invoked\s+oom-killer:)"
    r"|(?P<k8s>Reason:[ \t]*OOMKilled\b|\"reason\":\s*\"OOMKilled\"|\"OOMKilled\":\s*true\b)",
    re.MULTILINE,
)
# A word of each of _KERNEL's branches (clauses.mentions).
_KERNEL_WORDS = ("kill process", "killed process", "oom-kill", "oomkilled")
_KERNEL_FIGURES = re.compile(r"\b(?:total-vm|anon-rss):\d+kB")
_ANON_RSS = re.compile(r"\banon-rss:(?P<kb>\d+)kB")
_TASK = re.compile(r",task=(?P<name>[^,\n]{1,64}),pid=(?P<pid>\d+)")
MAX_KERNEL_LINES = 64
# The pid as printed, elided or redacted when pasted ("(pid ...)", "(pid XXXX)", "(pid(s)
# 123)"), or left out, as issue titles do ("DataLoader worker is killed by signal: Killed.").
_DATALOADER = re.compile(
    r"DataLoader\s+worker\s+(?:\(pid(?:\(s\)|s)?\s*(?:(?P<pid>\d+)\)|[^()\n]{1,40}\))\s+)?"
    r"is\s+killed\s+by\s+signal:\s+"
    r"(?:(?P<killed>Killed)|Bus\s+error)\b"
    r"|Unexpected\s+bus\s+error\s+encountered\s+in\s+worker"
)
_DATALOADER_WORDS = ("killed by signal", "unexpected bus error")


def find_oom_killer(window: str) -> list[Found]:
    """The processes the kernel's OOM killer killed in ``window``: one per PID, whichever
    of its lines were pasted (a kill without a PID only where no line names one)."""
    lines = spans(window, _KERNEL, limit=600, needs=_KERNEL_WORDS)[:MAX_KERNEL_LINES]
    matches = [(span, _KERNEL.match(window, span.start)) for span in lines]
    cgroup = any(
        m and (m["memcg"] or m["k8s"] or m["constraint"] == "CONSTRAINT_MEMCG") for _, m in matches
    )
    by_pid: dict[int | None, Found] = {}
    for span, match in matches:
        assert match is not None
        ends = line_end(window, match.end())
        pid: int | None = None
        rss = None
        if match["pid"]:
            if not match["oom"] and not _KERNEL_FIGURES.search(window, match.end(), ends):
                continue  # "Killed process 42 (make)" from some other program
            pid = int(match["pid"])
            rss = _ANON_RSS.search(window, match.end(), ends)
        elif match["constraint"]:
            task = _TASK.search(window, match.end(), ends)
            pid = int(task["pid"]) if task else None
        earlier = by_pid.get(pid)
        if earlier is None:
            facts = OomFacts(
                kind="host",
                category="cgroup_oom_killer" if cgroup else "linux_oom_killer",
                device_type="host",
                pid=pid,
                message=span.snippet,
            )
            earlier = by_pid[pid] = Found(span.start, facts)
        if rss and earlier.facts.process_in_use_bytes is None:
            earlier.facts.process_in_use_bytes = int(rss["kb"]) * 1024
            earlier.facts.message = span.snippet  # the line with the figures says the most
    if len(by_pid) > 1:
        by_pid.pop(None, None)
    return list(by_pid.values())


def killed_process(message: str) -> str | None:
    """The name of the process the OOM killer killed, as its line prints it."""
    match = _KERNEL.search(message)
    while match is not None and not match["name"]:
        match = _KERNEL.search(message, match.end())
    if match is not None:
        return match["name"]
    task = _TASK.search(message)
    return task["name"] if task else None


def find_dataloader(window: str) -> list[Found]:
    """PyTorch DataLoader workers killed by SIGKILL or SIGBUS (/dev/shm) in ``window``."""
    found = []
    for span in spans(window, _DATALOADER, limit=400, needs=_DATALOADER_WORDS)[:16]:
        match = _DATALOADER.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="host",
            category="dataloader_worker_sigkilled"
            if match["killed"]
            else "dataloader_shm_exhausted",
            exception=exception_before(window, span.start),
            device_type="host",
            pid=int(match["pid"]) if match["pid"] else None,
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def find_cpu_allocator(window: str) -> list[Found]:
    """Every refusal of PyTorch's CPU allocator in ``window``."""
    found = []
    for span in spans(window, _CPU_ALLOCATOR, limit=300):
        match = _CPU_ALLOCATOR.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="host",
            category="cpu_allocator_out_of_memory",
            exception=exception_before(window, span.start),
            device_type="host",
            requested_bytes=span.size(_TH_SIZE) if match["th"] else int(match["bytes"]),
            message=span.snippet,
        )
        found.append(Found(span.start, facts))
    return found


def find(window: str) -> list[Found]:
    """The first SIGKILLed worker in ``window`` (the summary repeats it)."""
    for span in spans(window, _SIGKILL, limit=400)[:1]:
        pid = _PID.search(window, span.start, span.end)
        facts = OomFacts(
            kind="host",
            category="worker_sigkilled_host_oom_suspect",
            device_type="host",
            pid=int(pid["pid"] or pid["pid2"]) if pid else None,
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []


def find_applications(window: str) -> list[Found]:
    """The first refusal of system RAM in an application's own words in ``window`` (each
    prints one failure on several lines), then the kernel's OOM kills, the DataLoader's
    killed workers and the CUDA compiler's (:data:`~gpuwatch.doctor.families.FAMILIES`
    runs this for all four)."""
    return [
        *_find_application(window),
        *find_oom_killer(window),
        *find_dataloader(window),
        *_find_compiler(window),
        *_find_scheduler_kill(window),
    ]


# A batch scheduler's or a person's report that the kernel's OOM killer (or a memory
# cgroup) ended the job, without the kernel's own lines: Slurm's "srun: error: gpu001:
# task 0: Out Of Memory" and slurmstepd's "Detected 1 oom_kill event(s) in StepId=...",
# or prose, "killed by OOM killer", "`ketos train` OOM-killed on ...". Not "OOMKilled"
# run together (Kubernetes' reason, read above only where its status field prints it,
# since pull requests and code name it too).
_SCHEDULER_KILL = re.compile(
    r"(?P<slurm>\bsrun:\s+error:\s+(?P<node>[\w.-]{1,64}):\s+tasks?\s+[\d,-]{1,40}:\s+Out\s+Of\s+Memory\b"
    r"|\bDetected\s+\d+\s+oom[-_]kill\s+events?\b)"
    r"|(?i:\bkilled\s+by\s+(?:the\s+)?(?:linux\s+|kernel(?:'s)?\s+)?oom[\s-]?killer\b"
    r"|\boom[\s-]killed\b)"
)
_SCHEDULER_KILL_WORDS = ("out of memory", "oom_kill", "oom-kill", "oom kill", "oomkill")


def _find_scheduler_kill(window: str) -> list[Found]:
    """The first job a scheduler or a person says the OOM killer ended in ``window``."""
    for span in spans(window, _SCHEDULER_KILL, limit=300, needs=_SCHEDULER_KILL_WORDS)[:1]:
        match = _SCHEDULER_KILL.match(window, span.start)
        assert match is not None
        facts = OomFacts(
            kind="host",
            category="cgroup_oom_killer" if match["slurm"] else "linux_oom_killer",
            device_type="host",
            host=match["node"],  # the node Slurm ran the task on
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []


# A person's report of host RAM running out in words, "CPU OOM" or "CPU out of memory",
# only after a verb that says it was met ("I see CPU OOM errors during ...", "it hits a CPU
# out of memory"): advice ("to avoid CPU OOM") and questions about it are not a failure.
_CPU_OOM_TOLD = re.compile(
    r"(?i:\b(?:see|sees|saw|seeing|get|gets|got|getting|hit|hits|hitting|encounter(?:s|ed|ing)?"
    r"|r[au]n(?:s|ning)?\s+into|throws|threw|raised|gives|gave|caus(?:es|ed|ing)"
    r"|(?:crash|fail|di)(?:es|s|ed|ing)?\s+with|ends?\s+in)\s+(?:(?:a|an|the|some|many|frequent"
    r"|random|an?\s+\w+)\s+)?)(?P<what>(?i:cpu)[ \t-]+(?:OOM|(?i:out[ \t-]+of[ \t-]+memory)))"
    r"(?![\w-])"
)
_CPU_OOM_WORDS = ("cpu oom", "cpu out of memory", "cpu-oom", "cpu out-of-memory")


def find_told(window: str) -> list[Found]:
    """The first report in words that host RAM ran out ("I see CPU OOM errors") in
    ``window``: a fallback, read only where no family found a message."""
    for span in spans(window, _CPU_OOM_TOLD, limit=300, needs=_CPU_OOM_WORDS)[:1]:
        facts = OomFacts(
            kind="host",
            category="host_oom_in_words",
            device_type="host",
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []


def _find_compiler(window: str) -> list[Found]:
    """The first CUDA compiler out of system RAM in ``window`` (a build prints one per
    file that failed)."""
    for span in spans(window, _COMPILER, limit=400, needs=("ptxas", "catastrophic", "died"))[:1]:
        facts = OomFacts(
            kind="host",
            category="compiler_out_of_memory",
            device_type="host",
            exception=exception_before(window, span.start),
            message=span.snippet,
        )
        return [Found(span.start, facts)]
    return []


def _find_application(window: str) -> list[Found]:
    for span in spans(window, _APPLICATIONS, limit=600, needs=_APPLICATION_WORDS)[
        :MAX_APPLICATION_TRIES
    ]:
        match = _APPLICATIONS.match(window, span.start)
        assert match is not None
        if match["ollama"] and not match["need"] and not _reported(window, span):
            continue  # "the 70B model requires more system memory than is available" in prose
        return [Found(span.start, _application(window, span, match))]
    return []


# Ollama's refusal without its sizes is an error's text: "Error: ...", '{"error":"...'.
_ERROR_BEFORE = re.compile(r"error", re.IGNORECASE)


def _reported(window: str, span: Span) -> bool:
    """Whether the line says an error before the match (Ollama's client prints its text)."""
    return _ERROR_BEFORE.search(window, span.line_lookback, span.start) is not None


def _application(window: str, span: Span, match: re.Match[str]) -> OomFacts:
    requested = free = None
    shape = dtype = None
    if match["ollama"]:
        category = "ollama_system_memory"
        requested = parse_size(match["need"]) if match["need"] else None
        free = parse_size(match["free"]) if match["free"] else None
    elif match["unity"] or match["unity_allocator"]:
        category = "unity_out_of_memory"
        size = _UNITY_SIZE.search(window, span.start, span.start + UNITY_SIZE_LOOKAHEAD_CHARS)
        requested = int(size["bytes"]) if size else int(match["large"] or 0) or None
    elif match["unreal"]:
        category = "unreal_out_of_memory"
        requested = int(match["unreal_bytes"])
    elif match["jvm_heap"]:
        category = "jvm_heap_exhausted"
        requested = int(match["jvm_bytes"]) if match["jvm_bytes"] else None
        free = int(match["jvm_free"]) if match["jvm_free"] else None
    elif match["jvm_off_heap"]:
        category = "jvm_off_heap_exhausted"
    else:
        category = "lmcache_buffer_full"
        requested = int(match["block"]) if match["block"] else None
        tensor = _TORCH_TENSOR.search(match["tensor"] or "")
        shape, dtype = (tensor["shape"], tensor["dtype"]) if tensor else (None, None)
    return OomFacts(
        kind="host",
        category=category,
        exception=exception_before(window, span.start),
        device_type="host",
        requested_bytes=requested,
        free_bytes=free,
        tensor_shape=shape,
        dtype=dtype,
        message=span.snippet,
    )
