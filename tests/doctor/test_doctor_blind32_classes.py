"""The classes blind-32 showed missing: the Java virtual machine's OutOfMemoryError (host
RAM: the heap's limit, or a pool outside the heap), and NVENC's status 10 after a call the
encoder's API names, on a line that does not name the encoder.

The lines are written for the class they stand for, in wordings other than the held-out
corpus's (test_doctor_heldout.py has the real ones), and each class has near misses.
"""

from __future__ import annotations

from typing import Any

from doctor.class_tables import class_tests
from gpuwatch.doctor.explain import explain

POSITIVE: list[tuple[str, dict[str, Any]]] = [
    (
        "25/01/09 11:02:13 ERROR Executor: Exception in task 3.0 in stage 7.0 (TID 91)\n"
        "java.lang.OutOfMemoryError: Java heap space\n"
        "\tat java.util.Arrays.copyOf(Arrays.java:3236)",
        {"kind": "host", "category": "jvm_heap_exhausted", "device_type": "host"},
    ),
    (
        'Exception in thread "dispatcher-event-loop-1" java.lang.OutOfMemoryError: GC overhead '
        "limit exceeded",
        {"kind": "host", "category": "jvm_heap_exhausted"},
    ),
    (
        "java.lang.OutOfMemoryError: Requested array size exceeds VM limit",
        {"kind": "host", "category": "jvm_heap_exhausted"},
    ),
    (
        "E AndroidRuntime: java.lang.OutOfMemoryError: Failed to allocate a 33177612 byte "
        "allocation with 16777216 free bytes and 24MB until OOM, target footprint 268435456",
        {
            "kind": "host",
            "category": "jvm_heap_exhausted",
            "requested_bytes": 33177612,
            "free_bytes": 16777216,
        },
    ),
    (
        "Caused by: java.lang.OutOfMemoryError: Cannot reserve 16777216 bytes of direct buffer "
        "memory (allocated: 1065353216, limit: 1073741824)",
        {"kind": "host", "category": "jvm_off_heap_exhausted"},
    ),
    (
        "java.lang.OutOfMemoryError: Direct buffer memory\n\tat java.nio.Bits.reserveMemory",
        {"kind": "host", "category": "jvm_off_heap_exhausted"},
    ),
    (
        "java.lang.OutOfMemoryError: Metaspace",
        {"kind": "host", "category": "jvm_off_heap_exhausted"},
    ),
    # NVENC's status 10 after one of its API's calls, the encoder's prefix lost.
    (
        "InitializeEncoder failed: out of memory (10): (no details)",
        {"kind": "nvenc", "api_call": "nvEncInitializeEncoder", "cuda_error_code": 10},
    ),
    (
        "> CreateInputBuffer failed: out of memory (10)",
        {"kind": "nvenc", "api_call": "nvEncCreateInputBuffer"},
    ),
]


NEGATIVE = [
    # The JVM's other errors: threads, not memory; a stack, not the heap.
    "java.lang.OutOfMemoryError: unable to create native thread: possibly out of memory or "
    "process/resource limits reached",
    'Exception in thread "main" java.lang.StackOverflowError',
    # Settings and talk, not a failure.
    "spark.executor.memory 8g\nspark.driver.memory 4g",
    "If the job may fail with java.lang.OutOfMemoryError: Java heap space, raise -Xmx.",
    # "out of memory (10)" after a call that is not NVENC's, or quoted inside a sentence.
    "Frobnicate failed: out of memory (10)",
    "Users keep asking about `OpenEncodeSessionEx failed: out of memory (10)` in the channel.",
]


test_each_class_is_recognised_with_its_figures, test_near_misses_are_not_recognised = class_tests(
    POSITIVE, NEGATIVE
)


def test_jvm_heap_advice_raises_the_heap_not_system_ram() -> None:
    result = explain("java.lang.OutOfMemoryError: Java heap space")
    last = result.diagnoses[-1]
    assert "-Xmx" in last.summary
    commands = " ".join(last.commands)
    assert "spark.executor.memory" in commands and "-Xmx" in commands


def test_jvm_off_heap_advice_names_the_overhead() -> None:
    last = explain("java.lang.OutOfMemoryError: Direct buffer memory").diagnoses[-1]
    assert "spark.executor.memoryOverhead" in " ".join(last.commands)
    assert "MaxDirectMemorySize" in last.evidence
