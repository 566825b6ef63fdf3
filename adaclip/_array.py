"""Array-namespace lookup shared by the core modules (NumPy, PyTorch, JAX)."""

from __future__ import annotations

from typing import Any

from array_api_compat import array_namespace


def namespace(*arrays: Any) -> Any:
    """The array-API namespace of ``arrays``; Python scalars and ``None`` are ignored."""
    # Exact Python number types only: NumPy scalars (np.float64 subclasses float) are arrays here.
    return array_namespace(*[a for a in arrays if a is not None and type(a) not in (bool, int, float, complex)])
