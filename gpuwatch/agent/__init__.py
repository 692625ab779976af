"""The gpuwatch agent: poll NVML, export metrics, and push snapshots to the server."""
