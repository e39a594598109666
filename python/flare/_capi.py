"""The one ctypes binding of flare's C ABI (include/flare/flare.h); every Python layer goes through it.

It owns: the struct mirrors of flare.h (field by field, checked against the struct_size that
flare_*_params_init writes, so a layout drift fails loudly), finding and loading libflare, turning a
torch tensor into a flare_tensor view (no copy), and turning a failed status into a Python exception that
carries the library's message. It knows nothing about attention options beyond the struct fields; the torch
ops (ops.py) fill them in.

Finding the library, first match wins:
  1. the environment variable FLARE_LIBRARY (a path to libflare.so),
  2. libflare.so next to this file (where `pip install .` puts it),
  3. build/release/src/libflare.so of the source tree this file sits in (development).
"""

import ctypes
import functools
import os
import struct
import threading
from ctypes import c_char_p, c_float, c_int32, c_int64, c_size_t, c_uint8, c_uint64, c_void_p
from pathlib import Path

FLARE_MAX_RANK = 4

# flare_status
FLARE_OK = 0
FLARE_INVALID_ARGUMENT = 1
FLARE_UNSUPPORTED = 2
FLARE_OUT_OF_MEMORY = 3
FLARE_CUDA_ERROR = 4
FLARE_INTERNAL_ERROR = 5

# flare_dtype
FLARE_DTYPE_F32 = 0
FLARE_DTYPE_F16 = 1
FLARE_DTYPE_BF16 = 2
FLARE_DTYPE_F64 = 3
FLARE_DTYPE_I32 = 4
FLARE_DTYPE_E4M3 = 5

# flare_device_type
FLARE_DEVICE_CPU = 0
FLARE_DEVICE_CUDA = 1

# flare_arch_path (the CUDA kernel family of a forward or backward call), and its names in the Python API
FLARE_ARCH_PATH_AUTO = 0
FLARE_ARCH_PATH_SM80 = 80
FLARE_ARCH_PATH_SM90 = 90
ARCH_PATHS = {"auto": FLARE_ARCH_PATH_AUTO, "sm80": FLARE_ARCH_PATH_SM80, "sm90": FLARE_ARCH_PATH_SM90}

# torch dtype name -> flare_dtype (by name, so this module does not need torch to import)
_DTYPES = {
    "torch.float32": FLARE_DTYPE_F32,
    "torch.float16": FLARE_DTYPE_F16,
    "torch.bfloat16": FLARE_DTYPE_BF16,
    "torch.float64": FLARE_DTYPE_F64,
    "torch.int32": FLARE_DTYPE_I32,
    "torch.float8_e4m3fn": FLARE_DTYPE_E4M3,
}
_DEVICES = {"cpu": FLARE_DEVICE_CPU, "cuda": FLARE_DEVICE_CUDA}


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
        ("arch_path", c_int32),
        ("block_table", flare_tensor),
        ("sinks", flare_tensor),
        ("dropout_p", c_float),
        ("dropout_seed", c_uint64),
        ("dropout_offset", c_uint64),
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
        ("arch_path", c_int32),
        ("sinks", flare_tensor),
        ("dsinks", flare_tensor),
        ("dropout_p", c_float),
        ("dropout_seed", c_uint64),
        ("dropout_offset", c_uint64),
    ]


class flare_kvcache_params(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("q", flare_tensor),
        ("k_cache", flare_tensor),
        ("v_cache", flare_tensor),
        ("k_new", flare_tensor),
        ("v_new", flare_tensor),
        ("cache_seqlens", flare_tensor),
        ("cache_batch_idx", flare_tensor),
        ("cache_leftpad", flare_tensor),
        ("block_table", flare_tensor),
        ("rotary_cos", flare_tensor),
        ("rotary_sin", flare_tensor),
        ("rotary_interleaved", c_int32),
        ("num_splits", c_int32),
        ("out", flare_tensor),
        ("softmax_lse", flare_tensor),
        ("attn", flare_attn_options),
        ("exec", flare_exec_options),
        ("sinks", flare_tensor),
    ]


class FlareError(RuntimeError):
    """A status flare has no better Python exception for (FLARE_INTERNAL_ERROR, unknown codes)."""


class FlareCudaError(FlareError):
    """FLARE_CUDA_ERROR: the CUDA runtime reported an error."""


class FlareArgumentError(ValueError, RuntimeError):
    """An argument flare cannot take (FLARE_INVALID_ARGUMENT, or a check of the Python layer before the call).
    Both a ValueError (Python's convention) and a RuntimeError (what code written for flash_attn catches)."""


# status -> exception class; the message is always the library's own flare_last_error() text.
_EXCEPTIONS = {
    FLARE_INVALID_ARGUMENT: FlareArgumentError,
    FLARE_UNSUPPORTED: NotImplementedError,
    FLARE_OUT_OF_MEMORY: MemoryError,
    FLARE_CUDA_ERROR: FlareCudaError,
}


# flare_tensor's bytes: data, dtype, device (type, index), rank, shape[FLARE_MAX_RANK], strides[FLARE_MAX_RANK].
_TENSOR_PACK = struct.Struct(f"=Qiiii{FLARE_MAX_RANK}q{FLARE_MAX_RANK}q")
assert (_TENSOR_PACK.size == ctypes.sizeof(flare_tensor)
        and flare_tensor.shape.offset == struct.calcsize("=Qiiii")), "flare_tensor's layout changed"


def arch_path_value(arch_path):
    """The flare_arch_path of a Python arch_path ("auto", "sm80" or "sm90")."""
    value = ARCH_PATHS.get(arch_path)
    if value is None:
        raise FlareArgumentError(f"arch_path={arch_path!r}: it must be one of {', '.join(map(repr, ARCH_PATHS))}")
    return value


def tensor_view(t):
    """A flare_tensor viewing torch tensor t (no copy; t must stay alive for the call). None -> absent."""
    if t is None:
        return flare_tensor()  # rank 0: absent
    return _view(t.data_ptr(), t.dtype, t.device, t.shape, t.stride())


# The data pointer of a planned view: never read or written (validation looks at shapes, strides and alignment,
# not at an output's contents), non-null and aligned like any allocation, so the output passes the same checks
# the allocated one will.
_PLANNED_DATA = 4096


@functools.lru_cache(maxsize=256)
def planned_view(shape, dtype, device):
    """A flare_tensor for an output not allocated yet: torch.empty(shape, dtype, device)'s shape and strides,
    at a placeholder address. Lets flare validate a call before the Python layer allocates its outputs, which
    then only sets .data. Kept per (shape, dtype, device): the struct is copied wherever it is assigned."""
    strides, step = [], 1
    for extent in reversed(shape):  # contiguous, as torch.empty lays it out
        strides.append(step)
        step *= max(extent, 1)
    return _view(_PLANNED_DATA, dtype, device, shape, strides[::-1])


def _view(data, dtype_, device_, shape, strides):
    rank = len(shape)
    if rank > FLARE_MAX_RANK:
        raise FlareArgumentError(f"a tensor of rank {rank} is above FLARE_MAX_RANK ({FLARE_MAX_RANK})")
    if rank == 0:
        raise FlareArgumentError("flare takes no 0-d tensors (rank 0 means 'absent' in the C ABI)")
    dtype = _DTYPES.get(str(dtype_))
    if dtype is None:
        raise FlareArgumentError(f"flare does not take dtype {dtype_}")
    device = _DEVICES.get(device_.type)
    if device is None:
        raise FlareArgumentError(f"flare does not take tensors on device {device_}")
    pad = (0,) * (FLARE_MAX_RANK - rank)
    # One struct.pack and one copy: this runs for every tensor of every call, and setting the fields one by
    # one took 1.6 times as long (bench/cpu/host_cost.py: 6.4 against 4.1 us,
    # bench/results/host-cost-2026-12-03-e0deda4.json).
    return flare_tensor.from_buffer_copy(_TENSOR_PACK.pack(data, dtype, device, device_.index or 0, rank,
                                                           *shape, *pad, *strides, *pad))


# The same bytes packed straight into a field of a params struct, one Struct per rank (shape and strides
# zero-padded to FLARE_MAX_RANK): no flare_tensor object, no copy of one into the params.
_VIEW_PACKS = {rank: struct.Struct(f"=Qiiii{rank}q{8 * (FLARE_MAX_RANK - rank)}x{rank}q{8 * (FLARE_MAX_RANK - rank)}x")
               for rank in range(1, FLARE_MAX_RANK + 1)}
assert all(pack.size == _TENSOR_PACK.size for pack in _VIEW_PACKS.values())
_DTYPE_CODES = {}  # torch dtype object -> flare_dtype, filled on first sight (by name, as _DTYPES)


def set_view(params, offset, t):
    """Writes the flare_tensor view of torch tensor t (no copy; t must stay alive for the call) at byte offset of
    params: what `params.field = tensor_view(t)` does, for the per-call hot path (about 3 times faster). t is
    on the CPU or a CUDA device (the caller has checked)."""
    shape = t.shape
    try:
        pack = _VIEW_PACKS[len(shape)]
        code = _DTYPE_CODES[t.dtype]
    except KeyError:
        code = _DTYPES.get(str(t.dtype))
        if code is None or len(shape) not in _VIEW_PACKS:
            tensor_view(t)  # raises the dtype or rank error
        _DTYPE_CODES[t.dtype] = code
        pack = _VIEW_PACKS[len(shape)]
    if t.is_cuda:
        pack.pack_into(params, offset, t.data_ptr(), code, FLARE_DEVICE_CUDA, t.get_device(), len(shape), *shape,
                       *t.stride())
    else:
        pack.pack_into(params, offset, t.data_ptr(), code, FLARE_DEVICE_CPU, 0, len(shape), *shape, *t.stride())


# Four views in one pack: three rank-4 tensors in consecutive fields, two fields left zero (absent), a rank-1
# tensor: flare_kvcache_params' q, k_cache, v_cache, (k_new, v_new), cache_seqlens.
_KV_RUN_PACK = struct.Struct("=" + 3 * "Qiiii4q4q" + f"{2 * _TENSOR_PACK.size}x" + f"Qiiii1q{8 * (FLARE_MAX_RANK - 1)}x1q"
                             f"{8 * (FLARE_MAX_RANK - 1)}x")


def set_kv_views(params, offset, q, k, v, seqlens):
    """set_view of q, k, v (rank 4) and seqlens (rank 1) into the six consecutive flare_tensor fields from byte
    offset, the fourth and fifth zeroed: one pack instead of four set_view calls (a decode step's host cost,
    bench/cpu/host_cost.py). All on the CPU or all on one CUDA device, of dtypes seen before (the caller has
    checked); returns False, writing nothing, where a dtype has not been seen yet."""
    codes = _DTYPE_CODES
    cq, ck, cv, cs = codes.get(q.dtype), codes.get(k.dtype), codes.get(v.dtype), codes.get(seqlens.dtype)
    if cq is None or ck is None or cv is None or cs is None:
        return False
    device, index = (FLARE_DEVICE_CUDA, q.get_device()) if q.is_cuda else (FLARE_DEVICE_CPU, 0)
    _KV_RUN_PACK.pack_into(params, offset, q.data_ptr(), cq, device, index, 4, *q.shape, *q.stride(),
                           k.data_ptr(), ck, device, index, 4, *k.shape, *k.stride(),
                           v.data_ptr(), cv, device, index, 4, *v.shape, *v.stride(),
                           seqlens.data_ptr(), cs, device, index, 1, *seqlens.shape, *seqlens.stride())
    return True


def _problem_mask(params_type):
    """An int with the bits of a params struct that pose the problem set, and those that do not cleared: each
    tensor's data pointer (the alibi_slopes one inside attn too) and exec (stream, threads, workspace)."""
    mask = bytearray(b"\xff" * ctypes.sizeof(params_type))
    pointer = (flare_tensor.data.offset, ctypes.sizeof(c_void_p))
    for name, field_type in params_type._fields_:
        offset = getattr(params_type, name).offset
        if field_type is flare_tensor:
            offset, size = offset + pointer[0], pointer[1]
        elif field_type is flare_attn_options:
            offset, size = offset + flare_attn_options.alibi_slopes.offset + pointer[0], pointer[1]
        elif field_type is flare_exec_options:
            size = ctypes.sizeof(flare_exec_options)
        else:
            continue
        mask[offset:offset + size] = bytes(size)
    return int.from_bytes(mask, "little")


_PROBLEM_MASKS = {t: _problem_mask(t) for t in (flare_fwd_params, flare_bwd_params, flare_kvcache_params)}


class flare_merge_params(ctypes.Structure):
    _fields_ = [
        ("struct_size", c_size_t),
        ("out_a", flare_tensor),
        ("lse_a", flare_tensor),
        ("out_b", flare_tensor),
        ("lse_b", flare_tensor),
        ("out", flare_tensor),
        ("lse", flare_tensor),
        ("exec", flare_exec_options),
    ]


def problem_key(params):
    """The bytes of a params struct with its data pointers and exec cleared (as one int: a single AND): equal
    for two calls that pose the same problem (shapes, strides, dtypes, devices, options) on different data or
    streams. What flare decides from the params alone (the workspace size on CUDA, where it reads no tensor's
    contents) is the same for equal keys."""
    return type(params), int.from_bytes(bytes(params), "little") & _PROBLEM_MASKS[type(params)]


def _candidate_paths():
    env = os.environ.get("FLARE_LIBRARY")
    if env:
        return [Path(env)]  # an explicit choice: no silent fallback to another build
    here = Path(__file__).resolve().parent
    return [here / "libflare.so", here.parent.parent / "build" / "release" / "src" / "libflare.so"]


class Flare:
    """A loaded libflare: params constructors, entry points that raise on failure, introspection."""

    _PARAMS = (
        ("fwd", flare_fwd_params),
        ("bwd", flare_bwd_params),
        ("kvcache", flare_kvcache_params),
        ("merge", flare_merge_params),
    )

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
        lib.flare_dropout_mask.restype = c_int32
        lib.flare_dropout_mask.argtypes = [c_float, c_uint64, c_uint64, c_int64, c_int64, c_int64, c_int64,
                                           ctypes.POINTER(c_uint8)]
        entries = {
            flare_fwd_params: ("flare_fwd", "flare_fwd_varlen"),
            flare_bwd_params: ("flare_bwd", "flare_bwd_varlen"),
            flare_kvcache_params: ("flare_fwd_kvcache",),
            flare_merge_params: ("flare_merge_states",),
        }
        sizes = {
            flare_fwd_params: ("flare_fwd_workspace_size", True),
            flare_bwd_params: ("flare_bwd_workspace_size", True),
            flare_kvcache_params: ("flare_kvcache_workspace_size", False),
        }
        for struct, (entry, has_varlen) in sizes.items():
            fn = getattr(lib, entry)
            fn.restype = c_int32
            fn.argtypes = [ctypes.POINTER(struct)] + ([c_int32] if has_varlen else []) + [ctypes.POINTER(c_size_t)]
        for kind, struct in self._PARAMS:
            init = getattr(lib, f"flare_{kind}_params_init")
            init.restype = None
            init.argtypes = [ctypes.POINTER(struct)]
            for entry in entries[struct]:
                getattr(lib, entry).restype = c_int32
                getattr(lib, entry).argtypes = [ctypes.POINTER(struct)]
            p = struct()
            init(ctypes.byref(p))
            if p.struct_size != ctypes.sizeof(struct):
                raise FlareError(f"{struct.__name__}: the library says {p.struct_size} bytes, this binding "
                                 f"{ctypes.sizeof(struct)}: flare/_capi.py no longer mirrors flare.h "
                                 f"({self.path})")

    # ---- introspection
    def version(self):
        return self._lib.flare_version().decode()

    def cpu_isa(self):
        return self._lib.flare_cpu_isa().decode()

    def has_cuda(self):
        return bool(self._lib.flare_has_cuda())

    def build_config(self):
        """flare_build_config() as a dict of strings; None for a library older than that entry point."""
        try:
            fn = self._lib.flare_build_config
        except AttributeError:
            return None
        fn.restype = c_char_p
        fn.argtypes = []
        lines = fn().decode().splitlines()
        return dict(line.split("=", 1) for line in lines if "=" in line)

    # ---- params with every default set by the library
    def fwd_params(self):
        p = flare_fwd_params()
        self._lib.flare_fwd_params_init(ctypes.byref(p))
        return p

    def bwd_params(self):
        p = flare_bwd_params()
        self._lib.flare_bwd_params_init(ctypes.byref(p))
        return p

    def kvcache_params(self):
        p = flare_kvcache_params()
        self._lib.flare_kvcache_params_init(ctypes.byref(p))
        return p

    def kvcache_params_copy(self):
        """kvcache_params() from a copy of the bytes init wrote once (the defaults do not change): one copy
        instead of a call into the library."""
        template = self.__dict__.get("_kvcache_template")
        if template is None:
            template = self._kvcache_template = bytes(self.kvcache_params())
        return flare_kvcache_params.from_buffer_copy(template)

    def merge_params(self):
        p = flare_merge_params()
        self._lib.flare_merge_params_init(ctypes.byref(p))
        return p

    # ---- entry points
    def _check(self, entry, status):
        if status == FLARE_OK:
            return
        message = self._lib.flare_last_error().decode(errors="replace")
        name = self._lib.flare_status_string(status).decode()
        raise _EXCEPTIONS.get(status, FlareError)(f"{entry}: {name}: {message}")

    def fwd(self, params):
        self._check("flare_fwd", self._lib.flare_fwd(ctypes.byref(params)))

    def fwd_varlen(self, params):
        self._check("flare_fwd_varlen", self._lib.flare_fwd_varlen(ctypes.byref(params)))

    def bwd(self, params):
        self._check("flare_bwd", self._lib.flare_bwd(ctypes.byref(params)))

    def bwd_varlen(self, params):
        self._check("flare_bwd_varlen", self._lib.flare_bwd_varlen(ctypes.byref(params)))

    def fwd_kvcache(self, params):
        status = self._lib.flare_fwd_kvcache(params)  # ctypes passes the struct by reference (argtypes)
        if status != FLARE_OK:
            self._check("flare_fwd_kvcache", status)

    def dropout_mask(self, dropout_p, seed, offset, sequence, nheads, seqlen_q, seqlen_k, out_ptr):
        """flare_dropout_mask into the uint8 buffer at out_ptr ((nheads, seqlen_q, seqlen_k) bytes)."""
        self._check("flare_dropout_mask", self._lib.flare_dropout_mask(
            dropout_p, seed, offset, sequence, nheads, seqlen_q, seqlen_k, ctypes.cast(out_ptr, ctypes.POINTER(c_uint8))))

    def merge_states(self, params):
        self._check("flare_merge_states", self._lib.flare_merge_states(ctypes.byref(params)))

    # ---- scratch size queries (validate like the call; bytes the call would otherwise allocate itself)
    def fwd_workspace_size(self, params, varlen):
        n = c_size_t(0)
        self._check("flare_fwd_workspace_size",
                    self._lib.flare_fwd_workspace_size(ctypes.byref(params), int(varlen), ctypes.byref(n)))
        return n.value

    def bwd_workspace_size(self, params, varlen):
        n = c_size_t(0)
        self._check("flare_bwd_workspace_size",
                    self._lib.flare_bwd_workspace_size(ctypes.byref(params), int(varlen), ctypes.byref(n)))
        return n.value

    def kvcache_workspace_size(self, params):
        n = c_size_t(0)
        self._check("flare_kvcache_workspace_size",
                    self._lib.flare_kvcache_workspace_size(ctypes.byref(params), ctypes.byref(n)))
        return n.value


_library = None
_library_lock = threading.Lock()


def library():
    """The process-wide Flare, loaded on first use (see the module docstring for where it is looked for)."""
    global _library
    if _library is None:
        with _library_lock:
            if _library is None:
                tried = _candidate_paths()
                for path in tried:
                    if path.is_file():
                        _library = Flare(path)
                        break
                else:
                    raise OSError("libflare.so not found; looked at " + ", ".join(map(str, tried)) +
                                  ". Install the package with `pip install .`, build the release preset, "
                                  "or set FLARE_LIBRARY to the library's path.")
    return _library
