"""What this flare is and whether it works here: show_config() and self_check(), used by `python -m flare`.

Both read the loaded libflare (its flare_build_config() and introspection entry points) and torch; neither is
needed by the attention functions themselves.
"""

import math
import sys
import time

from ._capi import library


def config():
    """A dict describing this installation: package and library versions, library path, the CPU backend (the
    SIMD level in use and those compiled in), the CUDA backend (built or not, nvcc version, architectures,
    the sm90a path, head dims, passes), torch and the GPUs torch sees. Values are strings, bools, lists."""
    import torch

    from . import __version__

    lib = library()
    built = lib.build_config() or {}
    listed = lambda key: [x for x in built.get(key, "").split(",") if x]  # noqa: E731
    info = {
        "package_version": __version__,
        "library_version": lib.version(),
        "library_path": lib.path,
        "compiler": built.get("compiler", "unknown"),
        "cpu_isa": lib.cpu_isa(),
        "cpu_isas_built": listed("cpu_isas"),
        "cuda": lib.has_cuda(),
        "cuda_version": built.get("cuda_version", ""),
        "cuda_archs": listed("cuda_archs"),
        "cuda_sm90": built.get("cuda_sm90") == "1",
        "cuda_headdims": [int(d) for d in listed("cuda_headdims")],
        "cuda_passes": listed("cuda_passes"),
        "cuda_reason": built.get("cuda_reason", ""),
        "torch_version": torch.__version__,
        "torch_cuda": torch.version.cuda or "",
        "gpus": [],
    }
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            major, minor = torch.cuda.get_device_capability(i)
            info["gpus"].append({"index": i, "name": torch.cuda.get_device_name(i), "capability": f"{major}{minor}"})
    return info


def _gpu_note(info, gpu):
    if not info["cuda"]:
        return "not used: this libflare has no CUDA backend"
    cap = int(gpu["capability"])
    if cap < 80:
        return "not supported: flare's CUDA kernels need compute capability 8.0 or newer"
    archs = [int(a) for a in info["cuda_archs"] if a.isdigit()]
    if cap in archs:
        return "kernels built for it" + (" (sm90a path too)" if cap == 90 and info["cuda_sm90"] else "")
    lower = [a for a in archs if a < cap and a // 10 == cap // 10]
    if lower:
        return f"runs the sm_{max(lower)} kernels (same major version)"
    if archs and max(archs) < cap:
        return f"no kernels for it: JIT-compiled from compute_{max(archs)} PTX at first use"
    return "no kernels for it in this build"


def show_config(file=None):
    """Prints config() as a short report (to sys.stdout unless file is given): versions, library path,
    backends and what each GPU present will run."""
    out = file or sys.stdout
    info = config()
    rows = [
        ("flare", f"{info['package_version']} (library {info['library_version']})"),
        ("library", info["library_path"]),
        ("compiler", info["compiler"]),
        ("CPU backend", f"{info['cpu_isa']} kernels on this CPU"
         + (f" (built: {', '.join(info['cpu_isas_built'])})" if info["cpu_isas_built"] else "")),
    ]
    if info["cuda"]:
        rows.append(("CUDA backend", f"built with CUDA {info['cuda_version'] or '?'} for sm_"
                     + ", sm_".join(info["cuda_archs"]) + ("; sm90a forward" if info["cuda_sm90"] else "")))
        rows.append(("CUDA head dims", ", ".join(map(str, info["cuda_headdims"])) + " (passes: "
                     + ", ".join(info["cuda_passes"]) + ")"))
    else:
        rows.append(("CUDA backend", "not built (CPU tensors only)"
                     + (f": {info['cuda_reason']}" if info["cuda_reason"] else "")))
    rows.append(("torch", info["torch_version"] + (f" (CUDA {info['torch_cuda']})" if info["torch_cuda"] else "")))
    for gpu in info["gpus"]:
        rows.append((f"GPU {gpu['index']}", f"{gpu['name']}, sm_{gpu['capability']}: {_gpu_note(info, gpu)}"))
    if not info["gpus"]:
        rows.append(("GPUs", "none visible to torch"))
    if info["package_version"] != info["library_version"]:
        rows.append(("warning", "the package and the library versions differ: FLARE_LIBRARY or a stale build?"))
    width = max(len(k) for k, _ in rows)
    for key, value in rows:
        print(f"{key:<{width}}  {value}", file=out)


def _check_one(device, dtype, tolerance, headdim=64, backward=True):
    """A forward (and backward) through flash_attn_func on device against fp64 math; returns the worst error."""
    import torch

    from .flash_attn_interface import flash_attn_func

    gen = torch.Generator().manual_seed(0)
    b, sq, sk, h, hk, d = 2, 77, 133, 4, 2, headdim
    q, k, v = (torch.randn(b, s, n, d, generator=gen) for s, n in ((sq, h), (sk, hk), (sk, hk)))
    dout = torch.randn(b, sq, h, d, generator=gen)
    args = [t.to(device=device, dtype=dtype, copy=True).requires_grad_() for t in (q, k, v)]
    out = flash_attn_func(*args, causal=True)
    if backward:
        out.backward(dout.to(device=device, dtype=dtype))

    ref = [t.double().requires_grad_() for t in (q, k, v)]
    kr, vr = (t.repeat_interleave(h // hk, dim=2) for t in ref[1:])
    s = torch.einsum("bihd,bjhd->bhij", ref[0], kr) / math.sqrt(d)
    visible = torch.arange(sk).view(1, sk) <= torch.arange(sq).view(sq, 1) + (sk - sq)
    p = s.masked_fill(~visible, -math.inf).softmax(-1)
    out_ref = torch.einsum("bhij,bjhd->bihd", p, vr)
    out_ref.backward(dout.double())
    worst = 0.0
    pairs = zip([out] + [a.grad for a in args], [out_ref] + [r.grad for r in ref]) if backward else [(out, out_ref)]
    for got, want in pairs:
        err = (got.detach().double().cpu() - want.detach()).abs().max().item()
        if not err <= tolerance * (1 + want.abs().max().item()):
            raise AssertionError(f"{device} {dtype}: max error {err:.3g} above {tolerance:g}")
        worst = max(worst, err)
    return worst


def self_check(file=None):
    """Runs a forward and a backward on every device present (the CPU in fp32; each GPU the CUDA backend can
    use in bf16, with the head dims and passes the build has) against fp64 math, printing one line each.
    Returns True when all passed. A few seconds."""
    import torch

    out = file or sys.stdout
    info = config()
    checks = [("cpu", torch.float32, 1e-4, 64, True)]
    if info["cuda"] and info["cuda_headdims"]:
        # A kernel-development build may lack head dim 64 or the backward: check what it has.
        headdim = 64 if 64 in info["cuda_headdims"] else info["cuda_headdims"][0]
        backward = "bwd" in info["cuda_passes"]
        checks += [(f"cuda:{g['index']}", torch.bfloat16, 3e-2, headdim, backward)
                   for g in info["gpus"] if int(g["capability"]) >= 80]
    ok = True
    for device, dtype, tolerance, headdim, backward in checks:
        start = time.perf_counter()
        try:
            worst = _check_one(device, dtype, tolerance, headdim, backward)
            what = "forward and backward" if backward else "forward (this build has no backward kernels)"
            print(f"self-check {device} {str(dtype).removeprefix('torch.')}: ok, {what} (max error {worst:.2g}, "
                  f"{time.perf_counter() - start:.2f} s)", file=out)
        except Exception as e:  # report every device, then fail
            ok = False
            print(f"self-check {device} {str(dtype).removeprefix('torch.')}: FAILED: {type(e).__name__}: {e}",
                  file=out)
    return ok
