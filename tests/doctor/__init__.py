"""Tests of the OOM doctor, gpuwatch fit and the in-process PyTorch reporter."""
