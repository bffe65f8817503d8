"""raytrec's benchmarks, one per question; run each as ``python -m benchmarks.NAME`` (see
docs/benchmarks.md). Shared helpers are in :mod:`benchmarks.common`."""
