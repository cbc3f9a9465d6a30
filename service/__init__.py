"""stepserve: an HTTP inference server whose prefill and decode steps are compiled per bucket."""

__version__ = "0.1.0"
