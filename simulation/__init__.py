"""The fault-space simulation: seeded fault schedules run through the real coordinator over the
fake worker group, with the invariants a finished job must hold (``python -m simulation``).

A harness around the job, not a part of it: it builds a :class:`~actors.coordinator.Coordinator`
and reads its state, which no module of ``actors/`` does. It lives in the checkout with the test
doubles it and the tests use, and is not installed with the package:

- :mod:`simulation.doubles`: the fake worker group (fake ranks, nodes, training, faults, clock);
- :mod:`simulation.gloo_job`: a job of real rank engines, one process per rank on gloo
  (multi-process tests and benchmarks).
"""
