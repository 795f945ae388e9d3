"""flash_attn: an independent implementation of the FlashAttention 2.x API.

``flash_attn_func`` and its packed variants run FA1 / FA2 / FA3 CUDA kernels, chosen per device
(``available_backends``, ``select_backend``, FLASH_ATTN_BACKEND, ``backend=``). The package
imports without a GPU or without its compiled extension; calls then raise an error saying why.
"""

import importlib.metadata as _metadata

from ._version import __version__ as _source_version

try:
    # The distribution's version is what libraries gate on; the source file is the fallback for
    # a checkout that is imported without being installed.
    __version__ = _metadata.version("flash-attn")
except _metadata.PackageNotFoundError:
    __version__ = _source_version

from ._dispatch import BackendFallbackWarning, available_backends  # noqa: E402
from .flash_attn_interface import (  # noqa: E402
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
    select_backend,
)

__all__ = [
    "__version__",
    "flash_attn_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_kvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_with_kvcache",
    "available_backends",
    "select_backend",
    "BackendFallbackWarning",
]
