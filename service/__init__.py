"""stepserve: an HTTP inference server whose prefill and decode steps are compiled per bucket."""

import models  # noqa: F401  (first: loads the CPU BLAS before MLX; see models.load_cpu_blas)

__version__ = "0.1.0"
