"""raytrec: elastic 2D sparse-parallel training of TorchRec models on Ray.

The public entry point is :func:`fit`; configs live in :mod:`raytrec.config`. After training,
:func:`export`, :func:`load_model`, :func:`make_batch`, :func:`score`, :func:`evaluate` and
:func:`predict` (:mod:`raytrec.serving`) score the trained model outside the job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Result",
    "drain",
    "evaluate",
    "export",
    "fit",
    "load_model",
    "make_batch",
    "predict",
    "score",
    "stop",
]

if TYPE_CHECKING:
    from raytrec.api import Result, fit
    from raytrec.elastic.drain_policy import request_drain as drain
    from raytrec.elastic.drain_policy import request_stop as stop
    from raytrec.serving.evaluate import evaluate, predict
    from raytrec.serving.export import export, load_model, make_batch, score

_SERVING = {
    "evaluate": "raytrec.serving.evaluate",
    "predict": "raytrec.serving.evaluate",
    "export": "raytrec.serving.export",
    "load_model": "raytrec.serving.export",
    "make_batch": "raytrec.serving.export",
    "score": "raytrec.serving.export",
}


def __dir__() -> list[str]:
    # The public API is loaded lazily (below), so dir(), help() and a notebook's completion
    # would otherwise see none of it.
    return sorted({*__all__, *(n for n in globals() if n.startswith("__"))})


def __getattr__(name: str) -> Any:
    # Importing raytrec.config or raytrec.cluster.topology must not pull in torch, Ray
    # and the actors; the API is loaded on first use.
    if name == "drain":
        from raytrec.elastic.drain_policy import request_drain

        return request_drain
    if name == "stop":
        from raytrec.elastic.drain_policy import request_stop

        return request_stop
    if name in _SERVING:
        import importlib

        return getattr(importlib.import_module(_SERVING[name]), name)
    if name in __all__:
        from raytrec import api

        return getattr(api, name)
    raise AttributeError(f"module 'raytrec' has no attribute {name!r}")
