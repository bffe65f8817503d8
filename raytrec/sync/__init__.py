"""Sync schedules across gangs, straggler injection and a straggler simulator.

Everything here is pure (no torch, no Ray): :mod:`raytrec.sync.schedule`
decides which gangs average their state after which step,
:mod:`raytrec.sync.stragglers` decides which rank stalls for how long, and
:mod:`raytrec.sync.simulate` replays both on a clock model to predict the
speedup of local and hierarchical SGD over synchronous SGD.

Import from the submodules (``from raytrec.sync.schedule import plan_sync``): the package itself
imports nothing, so :mod:`raytrec.config` can use :mod:`raytrec.sync.stragglers` while
:mod:`raytrec.sync.schedule` uses :mod:`raytrec.config`.
"""
