"""A trained model outside training: export it unsharded, load it in one process, score rows.

* :mod:`~raytrec.serving.model_spec`: :class:`ModelSpec`, what rebuilds a model
(``model_spec.json``).
* :mod:`~raytrec.serving.export`: :func:`export`, :func:`load_model`, :func:`make_batch`.
* :mod:`~raytrec.serving.evaluate`: :func:`evaluate` (metrics) and :func:`predict` (Ray Data).

See docs/serving.md. Import from the submodules; ``raytrec`` re-exports the functions.
"""
