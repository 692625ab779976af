"""gpuwatch benchmarks: ratios against a baseline measured side by side in the same run."""
