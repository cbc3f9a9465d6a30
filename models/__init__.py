"""stepserve models: GGUF loading, the Llama-family decoder, tokenizer, KV cache and sampler.

Importing this package first loads a fast CPU BLAS when one is installed (see
:func:`load_cpu_blas`), so it must be imported before ``mlx.core``; ``service`` does that.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import sys

#: The BLAS library that MLX's CPU matmuls use, once :func:`load_cpu_blas` has run.
CPU_BLAS: str = "bundled"


def load_cpu_blas() -> str:
    """Make MLX's CPU backend use OpenBLAS instead of the reference BLAS of the Linux wheel.

    The ``mlx[cpu]`` wheel for Linux links netlib's reference BLAS (``libblas``); its
    ``sgemm`` ran a [512, 576] x [576, 1536] float32 matmul in 148 ms here against 9 ms for
    OpenBLAS. Loading ``libopenblas.so.0`` (Debian: ``libopenblas0-pthread``) with
    ``RTLD_GLOBAL`` before ``libmlx.so`` is loaded makes the dynamic linker bind MLX's
    ``cblas_sgemm`` calls to OpenBLAS. Quantized matmuls are MLX's own kernels and are
    unaffected. No-op off Linux, when MLX is already imported, or when OpenBLAS is absent.

    Returns:
        "openblas" when OpenBLAS was loaded, else "bundled".
    """
    global CPU_BLAS
    if sys.platform != "linux" or "mlx.core" in sys.modules or CPU_BLAS != "bundled":
        return CPU_BLAS
    name = ctypes.util.find_library("openblas") or "libopenblas.so.0"
    try:
        ctypes.CDLL(name, mode=ctypes.RTLD_GLOBAL)
    except OSError:
        return CPU_BLAS
    CPU_BLAS = "openblas"
    return CPU_BLAS


load_cpu_blas()
