"""flare: exact attention without the n×n matrix — the Python package.

Layers (each its own module; arrows point down):
  flash_attn_interface  flash-attn 2.x-compatible functions (re-exported here)
  bert_padding          unpad_input / pad_input / index_first_axis with flash-attn's signatures
  rotary                apply_rotary_emb in plain torch, flash-attn's signature
  flash_attn_compat     install(): `import flash_attn` resolves to flare (opt-in, never on import)
  integrations/         transformers: attn_implementation="flare"
  sdpa                  torch SDPA provider (where torch has the hook)
  ops                   torch custom ops flare::fwd / flare::bwd / flare::fwd_kvcache (+ autograd, fake)
  _capi                 the one ctypes binding of the C ABI (include/flare/flare.h)
  _config               config(), show_config(), self_check(): what this installation is (python -m flare)
libflare is loaded on first use, not at import (see _capi for where it is looked for).
"""

from . import ops
from .ops import merge_attention_states
from ._capi import FlareArgumentError, FlareCudaError, FlareError, library
from ._config import config, self_check, show_config
from .flash_attn_interface import (
    flash_attn_func,
    flash_attn_kvpacked_func,
    flash_attn_qkvpacked_func,
    flash_attn_varlen_func,
    flash_attn_varlen_kvpacked_func,
    flash_attn_varlen_qkvpacked_func,
    flash_attn_with_kvcache,
)

# The one place the package version is written: pyproject.toml reads it from here, and a test checks that it
# matches the library's (CMakeLists.txt project VERSION).
__version__ = "0.1.0"


def version() -> str:
    """The loaded libflare's version ("major.minor.patch")."""
    return library().version()


def cpu_isa() -> str:
    """The SIMD level the CPU backend runs with ("amx", "avx512bf16", "avx512", "avx2", "generic")."""
    return library().cpu_isa()


def has_cuda() -> bool:
    """Whether the loaded libflare has a CUDA backend."""
    return library().has_cuda()


__all__ = [
    "FlareArgumentError",
    "FlareCudaError",
    "FlareError",
    "config",
    "cpu_isa",
    "flash_attn_func",
    "flash_attn_kvpacked_func",
    "flash_attn_qkvpacked_func",
    "flash_attn_varlen_func",
    "flash_attn_varlen_kvpacked_func",
    "flash_attn_varlen_qkvpacked_func",
    "flash_attn_with_kvcache",
    "has_cuda",
    "library",
    "merge_attention_states",
    "ops",
    "self_check",
    "show_config",
    "version",
]
