"""raytrec's benchmarks, one per question (docs/benchmarks.md); helpers in benchmarks.common."""
