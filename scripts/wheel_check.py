"""Inspects a built flare wheel and fails (exit 1) on anything a user would trip over. Used by
scripts/check-wheel.sh and scripts/build-wheel.sh; runnable on its own:

    python3 scripts/wheel_check.py dist/flare_attention-0.1.0-py3-none-linux_x86_64.whl [--json report.json]

Checked: the file name's tag (py3-none-<platform>: no CPython ABI), WHEEL and METADATA (name, Python and torch
requirements, licence), the files (every module of python/flare, flare/libflare.so, LICENSE, nothing else but
libraries auditwheel grafted), and libflare.so itself: the shared libraries it needs (the C/C++ and OpenMP
runtimes only: never libcudart, libcuda, libtorch or libpython), the newest glibc symbol version it needs, and
that it exports the C ABI alone. Prints a report: tag, sizes, needed libraries, minimum glibc, CUDA or not.
"""

import argparse
import ctypes
import json
import re
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What libflare.so may need: glibc's libraries, the GCC runtime and OpenMP (grafted by auditwheel as
# libgomp-<hash>.so.1 in a repaired wheel). The CUDA runtime is linked statically; the driver is dlopened.
ALLOWED_NEEDED = re.compile(r"^(libc\.so\.6|libm\.so\.6|libdl\.so\.2|libpthread\.so\.0|librt\.so\.1|"
                            r"ld-linux-x86-64\.so\.2|libgcc_s\.so\.1|libstdc\+\+\.so\.6|libgomp(-[0-9a-f]+)?\.so\.1(\.0\.0)?)$")
NAME = re.compile(r"^flare_attention-(?P<version>[^-]+)-py3-none-(?P<platform>linux_x86_64|"
                  r"(manylinux_\d+_\d+_x86_64\.?)+)\.whl$")


def fail(message):
    print(f"wheel_check: FAILED: {message}", file=sys.stderr)
    sys.exit(1)


def tool(*args):
    return subprocess.run(args, check=True, capture_output=True, text=True).stdout


def inspect_library(path):
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[([^\]]+)\]", tool("readelf", "-d", str(path)))
    symbols = tool("objdump", "-T", str(path))
    newest = lambda vs: max(vs, key=lambda v: tuple(map(int, v.split("."))), default="")  # noqa: E731
    glibc = newest(re.findall(r"\bGLIBC_(\d+(?:\.\d+)*)", symbols))
    glibcxx = newest(re.findall(r"\bGLIBCXX_(\d+(?:\.\d+)*)", symbols))
    exported = [line.split()[-1] for line in tool("nm", "-D", "--defined-only", str(path)).splitlines() if line.strip()]
    return needed, glibc, glibcxx, exported


def build_config(path):
    """The library's flare_build_config() as a dict (loading it runs no CUDA code)."""
    lib = ctypes.CDLL(str(path))
    lib.flare_build_config.restype = ctypes.c_char_p
    return dict(line.split("=", 1) for line in lib.flare_build_config().decode().splitlines())


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path)
    parser.add_argument("--json", type=Path, help="also write the report here")
    args = parser.parse_args()
    wheel = args.wheel
    match = NAME.match(wheel.name)
    if not match:
        fail(f"{wheel.name}: not flare_attention-<version>-py3-none-<linux_x86_64|manylinux_*>.whl")
    version = match["version"]
    expected = re.search(r'__version__ = "([^"]+)"', (REPO / "python/flare/__init__.py").read_text())[1]
    if version != expected:
        fail(f"{wheel.name}: version {version}, python/flare/__init__.py says {expected}")

    with zipfile.ZipFile(wheel) as z:
        names = {n for n in z.namelist() if not n.endswith("/")}  # a repaired wheel lists its folders too
        info = f"flare_attention-{version}.dist-info"
        wheel_meta = z.read(f"{info}/WHEEL").decode()
        metadata = z.read(f"{info}/METADATA").decode()
        if "flare/libflare.so" not in names:
            fail("no flare/libflare.so in the wheel")
        with tempfile.TemporaryDirectory() as tmp:
            z.extractall(tmp)  # the whole wheel: a repaired library finds its grafted OpenMP beside it
            library = Path(tmp) / "flare/libflare.so"
            needed, glibc, glibcxx, exported = inspect_library(library)
            library_size = library.stat().st_size
            built = build_config(library)

    tag = f"py3-none-{match['platform']}"
    if "Root-Is-Purelib: false" not in wheel_meta or not all(f"Tag: py3-none-{p}" in wheel_meta
                                                            for p in match["platform"].split(".")):
        fail(f"WHEEL does not say a platform wheel tagged {tag}:\n{wheel_meta}")
    for line in ("Name: flare-attention", f"Version: {version}", "Requires-Python: >=3.10", "Requires-Dist: torch>=2.4"):
        if line not in metadata:
            fail(f"METADATA lacks '{line}'")
    if "BSD-3-Clause" not in metadata:
        fail("METADATA does not name the licence (BSD-3-Clause)")
    if not any(n.startswith(f"{info}/") and n.endswith("LICENSE") for n in names):
        fail("no LICENSE in the .dist-info")

    modules = {f"flare/{p.relative_to(REPO / 'python/flare').as_posix()}"
               for p in (REPO / "python/flare").rglob("*.py")}
    missing = sorted(modules - names)
    if missing:
        fail(f"modules of python/flare missing from the wheel: {', '.join(missing)}")
    grafted = {n for n in names if n.startswith("flare_attention.libs/")}
    extra = sorted(names - modules - grafted - {"flare/libflare.so"} - {n for n in names if n.startswith(f"{info}/")})
    if extra:
        fail(f"unexpected files in the wheel: {', '.join(extra)}")

    bad = [n for n in needed if not ALLOWED_NEEDED.match(n)]
    if bad:
        fail(f"libflare.so needs {', '.join(bad)}: only the C/C++ and OpenMP runtimes may be needed "
             "(the CUDA runtime is linked statically)")
    leaked = [s for s in exported if not s.startswith("flare_")]
    if leaked:
        fail(f"libflare.so exports {len(leaked)} symbols beyond the C ABI, e.g. {', '.join(leaked[:5])}")

    report = {
        "wheel": wheel.name,
        "tag": tag,
        "wheel_bytes": wheel.stat().st_size,
        "library_bytes": library_size,
        "needed": needed,
        "grafted": sorted(grafted),
        "min_glibc": glibc,
        "min_glibcxx": glibcxx,
        "cuda": built.get("cuda") == "1",
        "cuda_archs": built.get("cuda_archs", ""),
        "cuda_sm90": built.get("cuda_sm90", ""),
        "cuda_reason": built.get("cuda_reason", ""),
        "exports": len(exported),
    }
    for key, value in report.items():
        print(f"  {key:14} {value}")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
