"""Benchmarks and load tools (``stepserve bench …``, ``stepserve soak``): they measure a
server from the outside or the steps in-process. No serving module imports this package.
"""
