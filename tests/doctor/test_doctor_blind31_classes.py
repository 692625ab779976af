"""The classes blind-31 showed missing or misread: the Linux kernel's OOM killer (and a
container's kill), PyTorch DataLoader workers killed by SIGKILL or by SIGBUS for want of
shared memory, PyTorch's exception in a Jupyter traceback's header, llama.cpp's Metal
buffers (and Ollama's copy of that failure), and CuPy's exception name alone.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses: the
same program's other failures, settings that only name the mechanism, another library's
class of the same name.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests
from gpuwatch.doctor.explain import explain
from gpuwatch.doctor.parse import parse_oom

KIB = 1024
MIB = 1024**2

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    # The kernel's OOM killer, each of its lines alone and the whole dump.
    (
        "[Tue Mar  4 10:12:01 2025] Out of memory: Killed process 31877 (pt_main_thread) "
        "total-vm:92012348kB, anon-rss:61234568kB, file-rss:65536kB, shmem-rss:0kB, UID:1000 "
        "pgtables:121340kB oom_score_adj:0",
        {
            "kind": "host",
            "category": "linux_oom_killer",
            "device_type": "host",
            "pid": 31877,
            "process_in_use_bytes": 61234568 * KIB,
        },
    ),
    (
        "Mar 04 10:12:01 gpu-box kernel: oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),"
        "cpuset=/,mems_allowed=0-1,global_oom,task_memcg=/user.slice/user-1000.slice/session-3."
        "scope,task=torchrun,pid=8812,uid=1000",
        {"kind": "host", "category": "linux_oom_killer", "pid": 8812},
    ),
    (
        "[ 8812.551234] python invoked oom-killer: gfp_mask=0x140cca(GFP_HIGHUSER_MOVABLE|"
        "__GFP_COMP), order=0, oom_score_adj=0\n"
        "[ 8812.551240] CPU: 12 PID: 4410 Comm: python Not tainted 6.5.0-41-generic\n"
        "[ 8812.551399] oom-kill:constraint=CONSTRAINT_NONE,nodemask=(null),cpuset=/,"
        "mems_allowed=0,global_oom,task_memcg=/,task=python,pid=4410,uid=0\n"
        "[ 8812.551412] Out of memory: Killed process 4410 (python) total-vm:40960000kB, "
        "anon-rss:33554432kB, file-rss:0kB, shmem-rss:12kB, UID:0 pgtables:70000kB "
        "oom_score_adj:0\n"
        "[ 8812.901000] oom_reaper: reaped process 4410 (python), now anon-rss:0kB, "
        "file-rss:0kB, shmem-rss:0kB",
        {
            "kind": "host",
            "category": "linux_oom_killer",
            "pid": 4410,
            "process_in_use_bytes": 33554432 * KIB,
            "additional_messages": [],
        },
    ),
    # Before Linux 4.19: "Kill process ... or sacrifice child", then the figures.
    (
        "Out of memory: Kill process 2231 (java) score 913 or sacrifice child\n"
        "Killed process 2231 (java) total-vm:12345678kB, anon-rss:8388608kB, file-rss:0kB",
        {"kind": "host", "pid": 2231, "process_in_use_bytes": 8 * 1024**3},
    ),
    # A memory cgroup's limit: a container's, a pod's, a Slurm job's.
    (
        "Memory cgroup out of memory: Killed process 977 (python3) total-vm:20971520kB, "
        "anon-rss:15728640kB, file-rss:1024kB, shmem-rss:0kB, UID:0 pgtables:31000kB "
        "oom_score_adj:999",
        {"kind": "host", "category": "cgroup_oom_killer", "pid": 977},
    ),
    (
        "oom-kill:constraint=CONSTRAINT_MEMCG,nodemask=(null),cpuset=docker-4f1e.scope,"
        "mems_allowed=0,oom_memcg=/system.slice/docker-4f1e.scope,task=uvicorn,pid=120,uid=0",
        {"kind": "host", "category": "cgroup_oom_killer", "pid": 120},
    ),
    (
        "    Last State:     Terminated\n      Reason:       OOMKilled\n      Exit Code:    137",
        {"kind": "host", "category": "cgroup_oom_killer", "pid": None},
    ),
    (
        '"State": {"Status": "exited", "Running": false, "OOMKilled": true, "ExitCode": 137}',
        {"kind": "host", "category": "cgroup_oom_killer"},
    ),
    # PyTorch's DataLoader: SIGKILL, most likely the OOM killer.
    (
        "RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.",
        {
            "kind": "host",
            "category": "dataloader_worker_sigkilled",
            "pid": 19597,
            "exception": "RuntimeError",
        },
    ),
    (
        '  File "/usr/lib/python3/site-packages/torch/utils/data/_utils/signal_handling.py", '
        "line 66, in handler\n    _error_if_any_worker_fails()\n"
        "RuntimeError: DataLoader worker (pid 7) is killed by signal: Killed. ",
        {"kind": "host", "category": "dataloader_worker_sigkilled", "pid": 7},
    ),
    # ... and SIGBUS: /dev/shm too small.
    (
        "RuntimeError: DataLoader worker (pid 19597) is killed by signal: Bus error. It is "
        "possible that dataloader's workers are out of shared memory. Please try to raise "
        "your shared memory limit.",
        {"kind": "host", "category": "dataloader_shm_exhausted", "pid": 19597},
    ),
    (
        "ERROR: Unexpected bus error encountered in worker. This might be caused by "
        "insufficient shared memory (shm).",
        {"kind": "host", "category": "dataloader_shm_exhausted", "pid": None},
    ),
    # PyTorch's exception heading a Jupyter / IPython traceback, its message cut off.
    (
        "---------------------------------------------------------------------------\n"
        "OutOfMemoryError                          Traceback (most recent call last)\n"
        "Cell In[7], line 3\n      1 model.train()\n----> 3 out = model(batch)",
        {
            "kind": "pytorch_allocator",
            "category": "pytorch_caching_allocator_oom_first_line",
            "exception": "OutOfMemoryError",
        },
    ),
    (
        "torch.cuda.OutOfMemoryError               Traceback (most recent call last)\n"
        "<ipython-input-12-3c1e> in <module>\n----> 1 trainer.train()",
        {"kind": "pytorch_allocator", "exception": "torch.cuda.OutOfMemoryError"},
    ),
    (
        "torch.OutOfMemoryError  Traceback (most recent call last)",
        {"kind": "pytorch_allocator"},
    ),
    # The header and the message at the traceback's end: the message's figures win.
    (
        "OutOfMemoryError                          Traceback (most recent call last)\n"
        "----> 1 model(x)\n"
        "OutOfMemoryError: CUDA out of memory. Tried to allocate 20.00 MiB. GPU 0 has a total "
        "capacity of 7.79 GiB of which 3.50 MiB is free.",
        {
            "kind": "pytorch_allocator",
            "category": "pytorch_caching_allocator_oom_v2",
            "requested_bytes": 20 * MIB,
        },
    ),
    # llama.cpp's Metal buffers, with their sizes.
    (
        "ggml_gallocr_reserve_n: failed to allocate Metal buffer of size 34681522080\n"
        "llama_new_context_with_model: failed to allocate compute buffers",
        {
            "kind": "ggml",
            "category": "ggml_metal_alloc_failed",
            "device_type": "metal",
            "requested_bytes": 34681522080,
            "phase": "compute buffers",
        },
    ),
    (
        "ggml_metal_add_buffer: error: failed to allocate 'data            ' buffer, size = "
        "19283.21 MiB\nllama_load_model_from_file: failed to load model",
        {
            "kind": "ggml",
            "device_type": "metal",
            "requested_bytes": round(19283.21 * MIB),
        },
    ),
    (
        "ggml_backend_metal_buffer_type_alloc_buffer: error: failed to allocate buffer, size = "
        "17096.00 MiB\nllama_model_load: error loading model: unable to allocate backend buffer",
        {
            "kind": "ggml",
            "category": "ggml_metal_alloc_failed",
            "requested_bytes": 17096 * MIB,
            "phase": "model weights",
            "additional_messages": [],
        },
    ),
    # Ollama's copy, next to ggml's Metal lines, and alone.
    (
        'time=2024-05-01T10:00:00 level=INFO source=server.go:545 msg="waiting for server"\n'
        "ggml_metal_init: found device: Apple M2 Max\n"
        'time=2024-05-01T10:00:03 level=ERROR source=sched.go:344 msg="error loading llama '
        'server" error="llama runner process has terminated: error:failed to allocate '
        'buffer, size = 33074.89 MiB"',
        {"kind": "ggml", "device_type": "metal", "requested_bytes": round(33074.89 * MIB)},
    ),
    (
        "Error: llama runner process has terminated: error:failed to allocate buffer, size = "
        "1024.00 MiB",
        {"kind": "ggml", "device_type": None, "requested_bytes": 1024 * MIB},
    ),
    # CuPy's exception name alone: a title, a Jupyter header.
    (
        "cupy.cuda.memory.OutOfMemoryError in forward",
        {
            "kind": "cupy",
            "category": "cupy_oom_name_only",
            "exception": "cupy.cuda.memory.OutOfMemoryError",
        },
    ),
    (
        "cupy.cuda.memory.OutOfMemoryError          Traceback (most recent call last)",
        {"kind": "cupy"},
    ),
    (
        "[BUG] cuml KMeans raises cupy.cuda.OutOfMemoryError on 8 GB cards",
        {"kind": "cupy", "exception": "cupy.cuda.OutOfMemoryError"},
    ),
    # CuPy's whole message still reads its figures.
    (
        "cupy.cuda.memory.OutOfMemoryError: Out of memory allocating 25,600,000 bytes "
        "(allocated so far: 3,635,267,072 bytes).",
        {"kind": "cupy", "category": "cupy_oom", "requested_bytes": 25_600_000},
    ),
]


NEGATIVE = [
    # DataLoader workers dying of something other than memory.
    "RuntimeError: DataLoader worker (pid 2211) is killed by signal: Segmentation fault.",
    "RuntimeError: DataLoader worker (pid 2211) is killed by signal: Aborted.",
    "ERROR: Unexpected segmentation fault encountered in worker.",
    "RuntimeError: DataLoader worker (pid(s) 2211) exited unexpectedly",
    # Settings of the OOM killer, not a kill.
    "echo -1000 > /proc/self/oom_score_adj",
    "Mar 04 10:00:00 box systemd[1]: Set oom_score_adj to -900 for sshd.service",
    "vm.oom_kill_allocating_task = 0\nvm.panic_on_oom = 0",
    "kubelet: oom_score_adj for the guaranteed pod is -997",
    '"State": {"Status": "exited", "OOMKilled": false, "ExitCode": 1}',
    "Reason: Completed",
    # Another program's "Killed process" without the kernel's figures.
    "supervisord: Killed process 42 (celery) with SIGTERM after 10 s",
    # Java's OutOfMemoryError heading a traceback (its message, host RAM, is read:
    # test_doctor_blind32_classes.py), and another Error's header.
    "java.lang.OutOfMemoryError                Traceback (most recent call last)",
    "RuntimeError                              Traceback (most recent call last)",
    # "failed to allocate buffer, size = ..." from a program that is not ggml's.
    "libavcodec: failed to allocate buffer, size = 12.00 MiB for the frame pool",
    # Metal named where nothing failed.
    "ggml_metal_init: allocating\nggml_metal_init: found device: Apple M1 Pro\n"
    "ggml_backend_metal_buffer_type_alloc_buffer: allocated buffer, size = 4096.00 MiB",
    # Other libraries' classes named like CuPy's.
    "cupyx.scipy.sparse raises ValueError for this shape",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)


def test_gpu_out_of_memory_stays_the_gpus_beside_the_new_anchor_words() -> None:
    text = (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 23.64 GiB of which 1.19 GiB is free."
    )
    assert parse_oom(text).kind == "pytorch_allocator"
    # The JVM's own OOM is host RAM (blind-32), and the GPU's comes after it, as its own.
    both = parse_oom("java.lang.OutOfMemoryError: Java heap space\n" + text)
    assert [both.kind, *(m.kind for m in both.additional_messages)] == [
        "host",
        "pytorch_allocator",
    ]


def test_oom_killer_evidence_names_the_process_and_what_it_held() -> None:
    result = explain(
        "Out of memory: Killed process 25315 (python3) total-vm:48123456kB, "
        "anon-rss:30123456kB, file-rss:0kB, shmem-rss:0kB, UID:0 pgtables:60000kB"
    )
    last = result.diagnoses[-1]
    assert "python3 (pid 25315)" in last.evidence
    assert "28.73 GiB" in last.evidence
    assert any("dmesg" in command for command in last.commands)
    assert all(d.fix != "reduce_activations" for d in result.diagnoses)


def test_cgroup_kill_advice_raises_the_limit() -> None:
    result = explain("Memory cgroup out of memory: Killed process 977 (python3) total-vm:1kB")
    commands = " ".join(result.diagnoses[-1].commands)
    assert "memory.max" in commands and "--memory" in commands


def test_dataloader_sigkill_advice_says_oom_killer_and_dmesg() -> None:
    result = explain("RuntimeError: DataLoader worker (pid 19597) is killed by signal: Killed.")
    last = result.diagnoses[-1]
    assert "OOM killer" in last.evidence
    assert last.commands[0].startswith("sudo dmesg")


def test_dataloader_bus_error_advice_is_about_shared_memory() -> None:
    result = explain(
        "RuntimeError: DataLoader worker (pid 1) is killed by signal: Bus error. It is possible "
        "that dataloader's workers are out of shared memory."
    )
    last = result.diagnoses[-1]
    assert "/dev/shm" in last.evidence
    assert any("--shm-size" in command for command in last.commands)


def test_metal_buffer_advice_is_for_unified_memory() -> None:
    result = explain("ggml_gallocr_reserve_n: failed to allocate Metal buffer of size 34681522080")
    last = result.diagnoses[-1]
    assert "unified memory" in last.evidence
    assert any("iogpu.wired_limit_mb" in command for command in last.commands)


def test_many_kernel_lines_in_a_log_are_bounded() -> None:
    line = "Killed process 1 (x) total-vm:1kB, anon-rss:1kB\n"
    facts = parse_oom(line * 20000)
    assert facts.kind == "host" and facts.pid == 1
