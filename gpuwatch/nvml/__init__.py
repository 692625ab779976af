"""NVML: the only package that imports pynvml, and the fake GPUs that sit beneath it.

``library``  typed reads with errors translated at the boundary (real or fake GPUs alike)
``bounded``  per-device worker threads so a hung NVML call cannot stall a poll
``connect``  open a session on the real driver or on a fake-GPU scenario
``fake``     a stand-in for the C library (``pynvml.nvmlLib``) driven by a scenario file
"""
