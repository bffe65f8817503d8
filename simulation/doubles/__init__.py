"""Test doubles for the coordinator's worker group, used by the tests, the fault-space
simulation and the control-plane benchmark; not installed with the package.

- :mod:`~simulation.doubles.fake_group`: :class:`~simulation.doubles.fake_group.FakeWorkerGroup`,
  the coordinator's worker group without Ray, on a manual clock;
- :mod:`~simulation.doubles.fake_rank`: fake ranks and nodes, which implement
  :class:`~raytrec.elastic.rank_protocol.RankProtocol`;
- :mod:`~simulation.doubles.fake_model`: the model copies they hold;
- :mod:`~simulation.doubles.fake_training`: their training;
- :mod:`~simulation.doubles.fake_faults`: the fault schedule they carry out and the clock.
"""
