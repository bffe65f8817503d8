"""The fault-space simulation: seeded fault schedules run through the real coordinator over the
fake worker group, with the invariants a finished job must hold (``python -m jobs.fault_space``).

A harness around the job, not a part of it: it builds a :class:`~actors.coordinator.Coordinator`
and reads its state, which no module of ``actors/`` does.
"""
