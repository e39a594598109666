#!/usr/bin/env python3
"""Reads the machine code of the sm90 forward kernels and checks what the design needs, with no GPU:

  - each sm90 kernel is compiled for sm_90a and issues HGMMA (warpgroup MMA) instructions, both the SS form
    (S = Q·Kᵀ) and the RS form (O += P·V);
  - no local-memory traffic (LDL/STL) and no stack: nothing spilled;
  - the registers at entry fit the launch bounds (65536 / threads: setmaxnreg then moves them between roles);
  - setmaxnreg is present (the producer gives registers up, the consumers take them).

  tests/cuda/check_sm90_sass.py OBJECT_OR_LIBRARY... [--cuobjdump PATH] [--json OUT]

cuobjdump comes with the CUDA toolkit or the PyPI package nvidia-cuda-cuobjdump (nvidia/cu13/bin/cuobjdump);
without --cuobjdump the script looks on PATH, then in that package.
"""

import argparse
import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

# Threads per CTA of each head dim's configuration (src/cuda/sm90/tile_shape.hpp: 128 * (consumers + 1)).
THREADS = {64: 384, 96: 384, 128: 384, 192: 384, 256: 384}


def find_cuobjdump(given):
    if given:
        return given
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import nvidia  # the PyPI wheels' namespace package
        for root in nvidia.__path__:
            candidate = Path(root) / "cu13" / "bin" / "cuobjdump"
            if candidate.exists():
                return str(candidate)
    except ImportError:
        pass
    sys.exit("check_sm90_sass: cuobjdump not found (pip install nvidia-cuda-cuobjdump, or pass --cuobjdump)")


def kernels_of(cuobjdump, path):
    """{mangled name: {"sass": [lines], "regs": int, "stack": int, "local": int}} of the sm90 forward kernels."""
    usage = subprocess.run([cuobjdump, "--dump-resource-usage", str(path)], capture_output=True, text=True,
                           check=True).stdout
    kernels = {}
    current = None
    for line in usage.splitlines():
        m = re.match(r"\s*Function (\S+):", line)
        if m:
            current = m.group(1) if "sm9014forward_kernel" in m.group(1) else None
            continue
        m = re.search(r"REG:(\d+) STACK:(\d+) SHARED:(\d+) LOCAL:(\d+)", line)
        if m and current:
            kernels[current] = {"regs": int(m.group(1)), "stack": int(m.group(2)), "local": int(m.group(4)),
                                "sass": []}
    run = subprocess.run([cuobjdump, "--dump-sass", str(path)], capture_output=True, text=True)
    if run.returncode != 0:  # e.g. nvdisasm, which cuobjdump runs, not on PATH
        sys.exit(f"check_sm90_sass: cuobjdump --dump-sass {path} failed: {run.stderr.strip()}")
    sass = run.stdout
    current = None
    for line in sass.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1) if m.group(1) in kernels else None
            continue
        if current:
            kernels[current]["sass"].append(line)
    return kernels


def head_dim_of(name):
    m = re.search(r"FwdTraits.*?ELi(\d+)E", name)
    return int(m.group(1)) if m else None


def check(name, k):
    problems = []
    text = "\n".join(k["sass"])
    d = head_dim_of(name)
    ss = len(re.findall(r"HGMMA\.\S+\s+R\d+,\s*gdesc", text))
    rs = len(re.findall(r"HGMMA\.\S+\s+R\d+,\s*R\d+", text))
    hgmma = len(re.findall(r"\bHGMMA\.", text))
    if hgmma == 0:
        problems.append("no HGMMA instruction")
    if rs == 0:
        problems.append("no register-A HGMMA (P·V should read P from registers)")
    if re.search(r"\b(LDL|STL)\b", text):
        problems.append("local-memory traffic (LDL/STL): something spilled")
    if k["stack"] or k["local"]:
        problems.append(f"stack {k['stack']} / local {k['local']} bytes")
    if "USETMAXREG" not in text and "SETMAXREG" not in text:
        problems.append("no setmaxnreg: the register split between roles is missing")
    cap = 65536 // THREADS[d] if d in THREADS else None
    if cap is not None and k["regs"] > cap:
        problems.append(f"{k['regs']} registers at entry, above the launch bound's {cap}")
    return {"kernel": name, "headdim": d, "regs": k["regs"], "hgmma": hgmma, "hgmma_ss": ss, "hgmma_rs": rs,
            "problems": problems}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("paths", nargs="+")
    ap.add_argument("--cuobjdump")
    ap.add_argument("--json")
    args = ap.parse_args()
    cuobjdump = find_cuobjdump(args.cuobjdump)
    results = []
    for path in args.paths:
        for name, k in sorted(kernels_of(cuobjdump, path).items()):
            results.append(check(name, k))
    if not results:
        sys.exit("check_sm90_sass: no sm90 forward kernel found in " + ", ".join(args.paths))
    failed = 0
    for r in results:
        status = "ok" if not r["problems"] else "FAIL: " + "; ".join(r["problems"])
        failed += bool(r["problems"])
        print(f"hdim {r['headdim']}: {r['regs']} registers, {r['hgmma']} HGMMA ({r['hgmma_rs']} register-A) - "
              f"{status}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
