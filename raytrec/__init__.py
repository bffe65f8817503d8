"""raytrec: elastic 2D sparse-parallel training of TorchRec models on Ray.

The public entry point is :func:`fit`; configs live in :mod:`raytrec.config`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = ["Result", "drain", "fit"]

if TYPE_CHECKING:
    from raytrec.api import Result, fit
    from raytrec.elastic.drain import request_drain as drain


def __getattr__(name: str) -> Any:
    # Importing raytrec.config or raytrec.topology must not pull in torch, Ray
    # and the actors; the API is loaded on first use.
    if name == "drain":
        from raytrec.elastic.drain import request_drain

        return request_drain
    if name in __all__:
        from raytrec import api

        return getattr(api, name)
    raise AttributeError(f"module 'raytrec' has no attribute {name!r}")
