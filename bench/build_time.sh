#!/usr/bin/env bash
# Times a full CUDA build of flare (every architecture, head-dim tile, dtype and pass; no tests, no tools) from
# a fresh build directory and writes the result as JSON, for the build budget of docs/performance.md.
#
#   bench/build_time.sh OUT.json [JOBS]        JOBS default: the number of cores
# Environment: FLARE_CUTLASS_DIR (else CMake's own search), FLARE_COMMIT (recorded where there is no .git),
#   BUILD_DIR (default: a new temp dir, removed afterwards), EXTRA_CMAKE_ARGS (e.g. "-DFLARE_ARCHS=90"),
#   LIMIT_S (stop the build after this many seconds and still write the JSON, ok false; default: no limit).
# With Ninja the JSON also lists the slowest units and when each started and ended (from .ninja_log), so a build
# stopped by LIMIT_S still shows where its time went.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
out=${1:?usage: bench/build_time.sh OUT.json [JOBS]}
jobs=${2:-$(nproc)}
dir=${BUILD_DIR:-}
owned=0
[[ -z $dir ]] && { dir=$(mktemp -d /tmp/flare-build-time.XXXXXX); owned=1; }
commit=${FLARE_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
generator=()
command -v ninja >/dev/null && generator=(-G Ninja)
args=(-S . -B "$dir" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DFLARE_ENABLE_CUDA=ON -DFLARE_BUILD_TESTS=OFF
      -DFLARE_BUILD_TOOLS=OFF)
[[ -n ${FLARE_CUTLASS_DIR:-} ]] && args+=(-DFLARE_CUTLASS_DIR="$FLARE_CUTLASS_DIR")
# shellcheck disable=SC2206  # word splitting of the extra arguments is the point
[[ -n ${EXTRA_CMAKE_ARGS:-} ]] && args+=($EXTRA_CMAKE_ARGS)

t0=$(date +%s)
cmake "${args[@]}" >"$dir.configure.log" 2>&1 || { tail -20 "$dir.configure.log"; exit 1; }
t1=$(date +%s)
echo "configured in $((t1 - t0)) s; building with $jobs jobs ..."
rc=0
limit=()
[[ -n ${LIMIT_S:-} ]] && limit=(timeout "$LIMIT_S")
"${limit[@]}" cmake --build "$dir" -j "$jobs" >"$dir.build.log" 2>&1 || rc=$?
t2=$(date +%s)
tail -3 "$dir.build.log"
archs=$(grep -m1 '^FLARE_ARCHS' "$dir/CMakeCache.txt" | cut -d= -f2)
threads=$(grep -m1 '^FLARE_NVCC_THREADS' "$dir/CMakeCache.txt" | cut -d= -f2)
units=$(grep -c 'Building CUDA object' "$dir.build.log" || true)

python3 - "$out" "$commit" "$((t1 - t0))" "$((t2 - t1))" "$jobs" "$archs" "$units" "$rc" "$(nproc)" "$threads" \
  "$(nvcc --version | tail -1)" "${args[*]}" "$dir.build.log" "$dir/.ninja_log" "${LIMIT_S:-}" <<'PY'
import json, os, sys, datetime, platform
out, commit, conf, build, jobs, archs, units, rc, cores, threads, nvcc, args, log, ninja_log, limit = sys.argv[1:16]
tail = open(log, errors="replace").read().splitlines()[-3:]
# .ninja_log: "start_ms end_ms mtime output hash" per line, after a "# ninja log vN" header.
steps = []
if os.path.exists(ninja_log):
    for line in open(ninja_log, errors="replace"):
        f = line.split("\t")
        if line.startswith("#") or len(f) < 4:
            continue
        start, end = int(f[0]) / 1000, int(f[1]) / 1000
        steps.append({"unit": os.path.basename(f[3]).removesuffix(".o"), "start_s": start, "end_s": end,
                      "wall_s": round(end - start, 1)})
steps.sort(key=lambda x: -x["wall_s"])
json.dump({"meta": {"commit": commit, "date": datetime.date.today().isoformat(), "host": platform.node(),
                    "cores": int(cores), "nvcc": nvcc, "command": f"cmake {args} && cmake --build -j {jobs}"},
           "rows": [{"what": f"full build: FLARE_ARCHS={archs}, all head-dim tiles x fp16/bf16 x fwd/bwd + CPU backend"
                             + (f", FLARE_NVCC_THREADS={threads}" if threads else ""),
                     "configure_s": int(conf), "build_s": int(build), "jobs": int(jobs),
                     "cuda_units": int(units), "ok": rc == "0",
                     **({"stopped_after_s": int(limit)} if rc == "124" and limit else {})}],
           "slowest_steps": steps[:20], "steps_finished": len(steps),
           "log_tail": tail}, open(out, "w"), indent=1)
PY
echo "build: $((t2 - t1)) s (exit $rc) -> $out"
rm -f "$dir.configure.log" "$dir.build.log"
(( owned )) && rm -rf "$dir"
exit "$rc"
