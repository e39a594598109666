#!/usr/bin/env python3
"""Two or more builds of libflare timed against the same peers, alternating, in one call of the GPU machine.

bench_gpu.py loads one library per process (FLARE_LIBRARY), so each (round, build) is its own run of it, in
the order build A, build B, ... per round: a drift of the machine during the call then touches every build
alike, and a difference that holds in every round is the builds'. The peers (torch-flash, ...) run in every
run too, so each row's ratio is against a peer measured minutes, not sessions, apart. The runs' rows go into
one result file, each labelled with its build (`variant`) and round (`round`).

    python3 bench/gpu/ab_builds.py --out bench/results/gpu-ab-<date>-<sha>.json --rounds 2 \
        --build old=build/a/libflare.so.0.1.0 --build new=build/b/libflare.so.0.1.0 \
        --notes "what differs" -- --headdims 64 --impls flare torch-flash --no-memory

Everything after `--` goes to bench_gpu.py. Prints each run's table and, at the end, flare's TFLOP/s per
build (median over rounds) with the ratio of each build to the first.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
import meta  # noqa: E402

KEY = ("pass", "headdim", "seqlen_q", "causal")


def parse_args():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", required=True, help="the merged result JSON")
    ap.add_argument("--build", action="append", required=True, metavar="LABEL=LIBRARY",
                    help="a build to time (two or more); LABEL names it in the rows")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--notes", default="", help="what the builds differ in (meta.notes)")
    ap.add_argument("bench_args", nargs=argparse.REMAINDER, help="-- then bench_gpu.py's arguments")
    args = ap.parse_args()
    builds = []
    for item in args.build:
        label, sep, path = item.partition("=")
        if not sep or not label or not Path(path).is_file():
            ap.error(f"--build {item!r}: want LABEL=LIBRARY with an existing library file")
        builds.append((label, str(Path(path).resolve())))
    if len(builds) < 2:
        ap.error("give two or more --build")
    if len({label for label, _ in builds}) != len(builds):
        ap.error("the --build labels must differ")
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    extra = args.bench_args[1:] if args.bench_args[:1] == ["--"] else args.bench_args
    if "--out" in extra:
        ap.error("bench_gpu.py's --out is this tool's: leave it out after --")
    return args, builds, extra


def run_once(label, library, extra, workdir):
    """One bench_gpu.py run on `library`; returns its result file's content."""
    out_dir = Path(tempfile.mkdtemp(dir=workdir))
    env = dict(os.environ, FLARE_LIBRARY=library)
    cmd = [sys.executable, str(HERE / "bench_gpu.py"), "--out", str(out_dir), *extra]
    print(f"==== {label}: {' '.join(cmd[1:])}", flush=True)
    subprocess.run(cmd, env=env, check=True)
    results = sorted(out_dir.glob("*.json"))
    if len(results) != 1:
        raise RuntimeError(f"bench_gpu.py left {len(results)} result files in {out_dir}, expected 1")
    return json.loads(results[0].read_text())


def main():
    args, builds, extra = parse_args()
    rows, metas = [], {}
    with tempfile.TemporaryDirectory() as workdir:
        for rnd in range(1, args.rounds + 1):
            for label, library in builds:
                result = run_once(label, library, extra, workdir)
                metas.setdefault(label, result["meta"])
                for row in result["rows"]:
                    rows.append({**row, "variant": label, "round": rnd})

    first = builds[0][0]
    median = {}
    for label, _ in builds:
        per_key = {}
        for row in rows:
            if row["variant"] == label and row["impl"] == "flare" and row.get("tflops"):
                per_key.setdefault(tuple(row[k] for k in KEY), []).append(row["tflops"])
        median[label] = {k: statistics.median(v) for k, v in per_key.items()}
    print(f"\nflare TFLOP/s, median of {args.rounds} round(s); ratio to {first}")
    print("pass hd causal seqlen | " + " | ".join(f"{label:>14}" for label, _ in builds))
    for key in sorted(median[first], key=lambda k: (k[0], k[1], k[3], k[2])):
        cells = []
        for label, _ in builds:
            value = median[label].get(key)
            ratio = "" if value is None or label == first else f" {value / median[first][key]:.3f}x"
            cells.append("-" if value is None else f"{value:7.1f}{ratio}")
        print(f"{key[0]} {key[1]} {'yes' if key[3] else 'no'} {key[2]} | " + " | ".join(f"{c:>14}" for c in cells))

    out_meta = {
        **metas[first],  # device, software versions, shapes, timing: the same for every run
        **meta.provenance(__file__),
        "builds": {label: {"library": library, "flare_library": metas[label].get("flare_library")}
                   for label, library in builds},
        "rounds": args.rounds,
        "order": "per round, the builds in the order given; each run a bench_gpu.py process of its own",
        "notes": args.notes,
    }
    meta.write_result(args.out, {"meta": out_meta, "rows": rows})
    print(f"wrote {args.out} ({len(rows)} rows)")


if __name__ == "__main__":
    main()
