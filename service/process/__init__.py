"""The process side: start-up (loading models, the memory estimate), memory admission, the
engine watchdog and the SIGTERM drain.

May import :mod:`service.engine`; never :mod:`service.api` (errors reach HTTP as exceptions
that the API translates).
"""
