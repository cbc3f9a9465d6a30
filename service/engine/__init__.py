"""The engine side: the engine thread, scheduler, model runner, sequences, compile cache and
bucket table.

Only this package and :mod:`models` touch MLX; :mod:`service.engine.scheduler`,
:mod:`service.engine.sequence` and :mod:`service.engine.buckets` are plain Python. Only
:mod:`service.engine.compile_cache` compiles (MLX's compile function). Nothing here knows HTTP.
"""
