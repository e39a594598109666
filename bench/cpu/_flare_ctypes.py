"""Minimal ctypes binding of flare's C ABI (include/flare/flare.h) for the CPU benchmark.

Only what bench_cpu.py needs: the tensor view, the option structs, the forward and backward params and
their entry points, and the introspection calls. The structs mirror flare.h field by field; load()
checks their sizes against the struct_size that flare_*_params_init writes, so a layout drift fails
loudly instead of passing garbage. The Python package (python/flare) is the real binding; this one stays
small and torch-agnostic (tensors are read through data_ptr(), shape, stride() and dtype).
"""

import ctypes
import os
from ctypes import c_char_p, c_float, c_int32, c_int64, c_size_t, c_void_p

FLARE_MAX_RANK = 4

FLARE_OK = 0

FLARE_DTYPE_F32 = 0
FLARE_DTYPE_F16 = 1
FLARE_DTYPE_BF16 = 2
FLARE_DTYPE_F64 = 3
FLARE_DTYPE_I32 = 4

FLARE_DEVICE_CPU = 0
FLARE_DEVICE_CUDA = 1

# torch dtype name -> flare_dtype
_DTYPES = {
    "torch.float32": FLARE_DTYPE_F32,
    "torch.float16": FLARE_DTYPE_F16,
    "torch.bfloat16": FLARE_DTYPE_BF16,
    "torch.float64": FLARE_DTYPE_F64,
    "torch.int32": FLARE_DTYPE_I32,
}


class flare_device(ctypes.Structure):
    _fields_ = [("type", c_int32), ("index", c_int32)]


class flare_tensor(ctypes.Structure):
    _fields_ = [
        ("data", c_void_p),
        ("dtype", c_int32),
        ("device", flare_device),
        ("rank", c_int32),
        ("shape", c_int64 * FLARE_MAX_RANK),
        ("strides", c_int64 * FLARE_MAX_RANK),
    ]


class flare_attn_options(ctypes.Structure):
    _fields_ = [
        ("softmax_scale", c_float),
        ("softcap", c_float),
        ("causal", c_int32),
        ("window_left", c_int32),
        ("window_right", c_int32),
        ("alibi_slopes", flare_tensor),
    ]


class flare_exec_options(ctypes.Structure):
    _fields_ = [
        ("stream", c_void_p),
        ("num_threads", c_int32),
        ("workspace", c_void_p),
        ("workspace_size", c_size_t),
    ]


class flare_fwd_params(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("q", flare_tensor),
        ("k", flare_tensor),
        ("v", flare_tensor),
        ("out", flare_tensor),
        ("softmax_lse", flare_tensor),
        ("cu_seqlens_q", flare_tensor),
        ("cu_seqlens_k", flare_tensor),
        ("seqused_k", flare_tensor),
        ("max_seqlen_q", c_int32),
        ("max_seqlen_k", c_int32),
        ("attn", flare_attn_options),
        ("exec", flare_exec_options),
    ]


class flare_bwd_params(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("q", flare_tensor),
        ("k", flare_tensor),
        ("v", flare_tensor),
        ("out", flare_tensor),
        ("dout", flare_tensor),
        ("softmax_lse", flare_tensor),
        ("dq", flare_tensor),
        ("dk", flare_tensor),
        ("dv", flare_tensor),
        ("cu_seqlens_q", flare_tensor),
        ("cu_seqlens_k", flare_tensor),
        ("seqused_k", flare_tensor),
        ("max_seqlen_q", c_int32),
        ("max_seqlen_k", c_int32),
        ("deterministic", c_int32),
        ("attn", flare_attn_options),
        ("exec", flare_exec_options),
    ]


class FlareError(RuntimeError):
    """A flare entry point returned something other than FLARE_OK."""


def tensor_view(t):
    """A flare_tensor viewing a CPU torch tensor (no copy; the tensor must outlive the call)."""
    if t.dim() > FLARE_MAX_RANK:
        raise ValueError(f"rank {t.dim()} is above FLARE_MAX_RANK ({FLARE_MAX_RANK})")
    if t.device.type != "cpu":
        raise ValueError(f"this binding passes CPU tensors only, got one on {t.device}")
    view = flare_tensor()
    view.data = t.data_ptr()
    view.dtype = _DTYPES[str(t.dtype)]
    view.device = flare_device(FLARE_DEVICE_CPU, 0)
    view.rank = t.dim()
    for i, (size, stride) in enumerate(zip(t.shape, t.stride())):
        view.shape[i] = size
        view.strides[i] = stride
    return view


class Flare:
    """The loaded library: init helpers, checked entry points and introspection."""

    def __init__(self, path):
        self.path = os.path.abspath(path)
        lib = ctypes.CDLL(self.path)
        self._lib = lib
        for name in ("flare_last_error", "flare_version", "flare_cpu_isa"):
            getattr(lib, name).restype = c_char_p
            getattr(lib, name).argtypes = []
        lib.flare_status_string.restype = c_char_p
        lib.flare_status_string.argtypes = [c_int32]
        lib.flare_has_cuda.restype = c_int32
        lib.flare_has_cuda.argtypes = []
        lib.flare_fwd_params_init.restype = None
        lib.flare_fwd_params_init.argtypes = [ctypes.POINTER(flare_fwd_params)]
        lib.flare_bwd_params_init.restype = None
        lib.flare_bwd_params_init.argtypes = [ctypes.POINTER(flare_bwd_params)]
        lib.flare_fwd.restype = c_int32
        lib.flare_fwd.argtypes = [ctypes.POINTER(flare_fwd_params)]
        lib.flare_bwd.restype = c_int32
        lib.flare_bwd.argtypes = [ctypes.POINTER(flare_bwd_params)]
        # Layout check: the library's sizeof must equal ours.
        for struct, init in ((flare_fwd_params, lib.flare_fwd_params_init),
                             (flare_bwd_params, lib.flare_bwd_params_init)):
            p = struct()
            init(ctypes.byref(p))
            if p.struct_size != ctypes.sizeof(struct):
                raise FlareError(f"{struct.__name__}: the library says {p.struct_size} bytes, this binding "
                                 f"{ctypes.sizeof(struct)}: _flare_ctypes.py no longer mirrors flare.h")

    def version(self):
        return self._lib.flare_version().decode()

    def cpu_isa(self):
        return self._lib.flare_cpu_isa().decode()

    def has_cuda(self):
        return bool(self._lib.flare_has_cuda())

    def fwd_params(self):
        p = flare_fwd_params()
        self._lib.flare_fwd_params_init(ctypes.byref(p))
        return p

    def bwd_params(self):
        p = flare_bwd_params()
        self._lib.flare_bwd_params_init(ctypes.byref(p))
        return p

    def _check(self, entry, status):
        if status != FLARE_OK:
            name = self._lib.flare_status_string(status).decode()
            raise FlareError(f"{entry}: {name}: {self._lib.flare_last_error().decode()}")

    def fwd(self, params):
        self._check("flare_fwd", self._lib.flare_fwd(ctypes.byref(params)))

    def bwd(self, params):
        self._check("flare_bwd", self._lib.flare_bwd(ctypes.byref(params)))
