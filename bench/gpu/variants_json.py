#!/usr/bin/env python3
"""Turns the output of tools/cuda_variants (flare_cuda_variants) into a tuning result file: one row per
(variant, pass, head dim, seqlen, mask), BENCH.md's row fields plus the variant's name and the run's label;
the backward's per-pass times (time_stages lines) as `stages_us`; same_backward's comparisons as `check`.

Each input is `LABEL=PATH`: LABEL names the tree the binary was built from (a commit, or a commit plus a
description of the uncommitted change under test), PATH is the text the binary printed.

    python3 bench/gpu/variants_json.py --out bench/results/gpu-tuning-<date>-<sha>.json \
        --notes "what was compared" abc1234=run1.txt "abc1234+change=run2.txt"
"""

import argparse
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import meta  # noqa: E402

TOKENS = 16384  # tools/cuda_variants.cu: kTokens, kWidth
WIDTH = 2048
LINE = re.compile(r"^(?P<name>.+?)\s+hd\s+(?P<hd>\d+) seqlen\s+(?P<seqlen>\d+) (?P<mask>full|causal)\s+"
                  r"fwd\s+(?P<fwd>\d+) TFLOP/s(?:\s+bwd\s+(?P<bwd>\d+) TFLOP/s)?\s*(?P<error>.*)$")

# time_stages: the backward's passes one by one (microseconds; `total` with chained launches, `unchained`
# without, where the line has it). Two formats: this tool's, and that of
# b1a5893's tool, which also timed the passes before it ("memset A dsum B -> C ... dq D -> E total F -> G").
STAGES = re.compile(r"^(?P<name>.+?)\s+hd\s+(?P<hd>\d+) seqlen\s+(?P<seqlen>\d+) (?P<mask>full|causal)\s+us: "
                    r"dsum\s+(?P<dsum>[\d.]+) main\s+(?P<main>[\d.]+) dq\s+(?P<dq>[\d.]+) "
                    r"total\s+(?P<total>[\d.]+)(?: unchained\s+(?P<unchained>[\d.]+))?(?P<error>.*)$")
STAGES_B1A5893 = re.compile(
    r"^(?P<name>.+?)\s+hd\s+(?P<hd>\d+) seqlen\s+(?P<seqlen>\d+) (?P<mask>full|causal)\s+us: "
    r"memset\s+(?P<memset>[\d.]+) dsum\s+(?P<dsum_before>[\d.]+) ->\s+(?P<dsum>[\d.]+) "
    r"\(with zeroing\) main\s+(?P<main>[\d.]+) dq\s+(?P<dq_before>[\d.]+) ->\s+(?P<dq>[\d.]+) "
    r"total\s+(?P<total_before>[\d.]+) ->\s+(?P<total>[\d.]+)\s+max\|dq diff\| (?P<diff>\S+) "
    r"of max\|dq\| (?P<most>\S+)(?P<error>.*)$")
# same_backward: a variant's gradients against the shipped configuration's.
CHECK = re.compile(r"^(?P<name>.+?)\s+hd\s+(?P<hd>\d+) seqlen\s+(?P<seqlen>\d+) (?P<mask>full|causal)\s+check: "
                   r"unwritten (?P<unwritten>\d+), dK/dV differing (?P<differ>\d+), dQ max diff (?P<diff>\S+) of "
                   r"(?P<most>\S+) (?P<verdict>OK|FAILED)$")
STAGE_FIELDS = ("memset", "dsum_before", "dsum", "main", "dq_before", "dq", "total_before", "total", "unchained")


def parse(label, text):
    rows = []
    for line in text.splitlines():
        ck = CHECK.match(line)
        if ck:
            hd, seqlen = int(ck["hd"]), int(ck["seqlen"])
            rows.append({"impl": "flare-sm80", "variant": ck["name"].strip(), "pass": "bwd", "dtype": "bf16",
                         "batch": TOKENS // seqlen, "seqlen_q": seqlen, "seqlen_k": seqlen, "nheads": WIDTH // hd,
                         "nheads_k": WIDTH // hd, "headdim": hd, "causal": ck["mask"] == "causal", "run": label,
                         "check": {"unwritten": int(ck["unwritten"]), "dkdv_differing": int(ck["differ"]),
                                   "dq_max_abs_diff": float(ck["diff"]), "dq_max_abs": float(ck["most"]),
                                   "passed": ck["verdict"] == "OK"}})
            continue
        st = STAGES.match(line) or STAGES_B1A5893.match(line)
        if st:
            hd, seqlen = int(st["hd"]), int(st["seqlen"])
            fields = st.groupdict()
            row = {"impl": "flare-sm80", "variant": st["name"].strip(), "pass": "bwd", "dtype": "bf16",
                   "batch": TOKENS // seqlen, "seqlen_q": seqlen, "seqlen_k": seqlen, "nheads": WIDTH // hd,
                   "nheads_k": WIDTH // hd, "headdim": hd, "causal": st["mask"] == "causal", "run": label,
                   "stages_us": {f: float(fields[f]) for f in STAGE_FIELDS if fields.get(f) is not None}}
            if fields.get("diff") is not None:
                row.update(dq_max_abs_diff=float(fields["diff"]), dq_max_abs=float(fields["most"]))
            if st["error"].strip():
                row["error"] = st["error"].strip()
            rows.append(row)
            continue
        m = LINE.match(line)
        if not m:
            continue
        hd, seqlen = int(m["hd"]), int(m["seqlen"])
        base = {"impl": "flare-sm80", "variant": m["name"].strip(), "dtype": "bf16", "batch": TOKENS // seqlen,
                "seqlen_q": seqlen, "seqlen_k": seqlen, "nheads": WIDTH // hd, "nheads_k": WIDTH // hd,
                "headdim": hd, "causal": m["mask"] == "causal", "run": label}
        if m["error"]:
            base["error"] = m["error"]
        for pass_name in ("fwd", "bwd"):
            if m[pass_name] is not None:
                rows.append(dict(base, **{"pass": pass_name, "tflops": float(m[pass_name])}))
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("runs", nargs="+", metavar="LABEL=PATH")
    ap.add_argument("--out", required=True, help="result file to write (must not exist)")
    ap.add_argument("--device", default="NVIDIA H200")
    ap.add_argument("--notes", default="")
    args = ap.parse_args()
    out = Path(args.out)
    if out.exists():
        sys.exit(f"variants_json: {out} exists; result files are never rewritten")
    rows = []
    for run in args.runs:
        label, sep, path = run.partition("=")
        if not sep or not label:
            sys.exit(f"variants_json: '{run}' is not LABEL=PATH")
        parsed = parse(label, Path(path).read_text())
        if not parsed:
            sys.exit(f"variants_json: no result lines in {path}")
        rows += parsed
    run = meta.provenance(__file__)
    run.update(device=args.device, notes=args.notes,
               command="build/cuda/tools/flare_cuda_variants (tools/cuda_variants.cu: kernels launched directly, "
                       "CUDA events, median of 20 forward / 10 backward runs after 3 warm-up); " + run["command"])
    meta.write_result(out, {"meta": run, "rows": rows})
    print(f"wrote {len(rows)} rows to {out}")


if __name__ == "__main__":
    main()
