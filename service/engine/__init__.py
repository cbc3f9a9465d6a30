"""The engine side: the engine thread (:mod:`service.engine.core`) and the parts it composes
side by side — executor, token selector, decode batch, runner, prefiller, speculator, prefix
cache, scheduler — with sequences, the compile cache, the bucket table and the warm-up plan.

Only the engine composes: no part holds or calls another, and no module here imports one that
imports it back (``tests/unit/test_engine_imports.py``). Engines are built from settings by
:mod:`service.process.build` and warmed up by :mod:`service.process.warmer`, above this package.
Only this package and :mod:`models` touch MLX; :mod:`service.engine.scheduler`,
:mod:`service.engine.sequence` and :mod:`service.engine.buckets` are plain Python. Only
:mod:`service.engine.compile_cache` compiles (MLX's compile function). Nothing here knows HTTP.
"""
