"""gpuwatch: see shared-GPU out-of-memory coming, name the culprit, clean up safely.

The package is laid out by what flows through it::

    nvml/     the only code that imports pynvml, and the fake GPUs beneath it
    agent/    one poll -> HostSnapshot, Prometheus collectors, exporter, push + spool
    server/   central history (FastAPI + SQLAlchemy), detectors, events
    doctor/   OOM message parsing and diagnosis, VRAM arithmetic
    torch.py  optional in-process PyTorch allocator reporter (imports torch lazily)
"""

__version__ = "0.1.0"
