"""Silences known, harmless warnings from TorchRec and torch on every rank.

Each of these is printed once per rank per job and says nothing actionable
to a raytrec user; anything not listed here still shows.
"""

from __future__ import annotations

import logging
import warnings

_MESSAGES = (
    r"`broadcast_buffers` is deprecated",
    r"HeuristicalStorageReservation is known to cause issues",
)
_LOGGERS = (
    "torchrec.distributed.planner.types",  # "topology was constructed directly"
    "torchrec.distributed.planner.storage_reservations",  # dry-run dense size estimate
    "torch.fx._symbolic_trace",  # is_fx_tracing deprecation
)


def quiet_known_warnings() -> None:
    for message in _MESSAGES:
        warnings.filterwarnings("ignore", message=message)
    for name in _LOGGERS:
        logging.getLogger(name).setLevel(logging.ERROR)
