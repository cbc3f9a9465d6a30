"""The HTTP side: the app factory, routes, request and response schemas, errors, middleware.

May import :mod:`service.engine`, :mod:`service.process`, :mod:`service.config` and
:mod:`service.metrics`; never MLX directly. Handlers stay on the event loop and never run
model work: they submit to the engine and await its events.
"""
