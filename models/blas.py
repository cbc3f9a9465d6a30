"""Which BLAS MLX's CPU backend uses, and loading OpenBLAS ahead of the reference BLAS.

The ``mlx[cpu]`` wheel for Linux links netlib's reference BLAS (``libblas``, bundled in
``mlx_cpu.libs``). Loading ``libopenblas.so.0`` (Debian: ``libopenblas0-pthread``) with
``RTLD_GLOBAL`` before ``libmlx.so`` is loaded makes the dynamic linker bind MLX's
``cblas_sgemm`` calls to OpenBLAS instead. Quantized matmuls are MLX's own kernels and are
unaffected. The speed-up is measured in ``docs/BENCHMARKS.md``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys
from pathlib import Path

OPENBLAS_FIX = "apt-get install libopenblas0-pthread (Debian/Ubuntu), then restart"


def load_cpu_blas() -> str:
    """Load OpenBLAS globally so that MLX binds to it; call before ``mlx.core`` is imported.

    Entry points call it first (``stepserve``'s CLI, the test conftest). No-op off Linux,
    when OpenBLAS is absent, or when ``mlx.core`` is already imported (too late to bind).

    Returns:
        The BLAS in use afterwards, as :func:`cpu_blas` names it.
    """
    if sys.platform == "linux" and "mlx.core" not in sys.modules:
        name = ctypes.util.find_library("openblas") or "libopenblas.so.0"
        try:
            ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass
    return cpu_blas()


def cpu_blas() -> str:
    """``"openblas"`` when OpenBLAS is mapped into this process, ``"accelerate"`` on macOS
    (MLX uses Apple's Accelerate there), else ``"reference"`` (MLX's bundled netlib BLAS).

    Read from ``/proc/self/maps`` on Linux, so it reports what is loaded, not what was tried.
    """
    if sys.platform == "darwin":
        return "accelerate"
    maps = Path("/proc/self/maps")
    if maps.is_file() and "libopenblas" in maps.read_text(errors="replace"):
        return "openblas"
    return "reference"
