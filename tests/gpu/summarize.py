#!/usr/bin/env python3
"""The summary of a tests/gpu/run.sh run: reads the stage table run.sh wrote, the pytest junit XML, the
sanitizer logs and the bench/train result files, writes $OUT/gpu-tests-<date>.json and prints a short
report. Exit status: 1 if any stage failed or timed out, else 0.

Summary JSON: {"meta": {commit, dirty, date, started, finished, command, device, driver, torch, cuda, flare
library/version, ...}, "ok": bool, "stages": [{"name", "status" (passed | failed | timeout | skipped), "exit",
"seconds", "command", ...details}]}; details: tests: counts (tests, passed, failed, errors, skipped) and the
failing test ids with the first line of their message; sanitize-*: the sanitizer's error count and the
cases run; bench: result file, rows, flare rows at or above FA2, accuracy failures; train: result file and
flare-vs-sdpa comparison.
"""

import argparse
import datetime
import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(REPO / "bench" / "gpu"))

import meta as run_meta  # noqa: E402


def read_stages(work):
    stages = []
    path = Path(work) / "stages.tsv"
    if not path.is_file():
        return stages
    for line in path.read_text().splitlines():
        name, status, rc, seconds, command = (line.split("\t") + [""] * 5)[:5]
        stages.append({"name": name, "status": status, "exit": int(rc) if rc else None,
                       "seconds": int(seconds or 0), "command": command})
    return stages


def junit_details(path):
    if not path.is_file():
        return {"junit": "missing (pytest did not finish: killed, timed out or crashed; see run.log)"}
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    counts = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    counts["passed"] = counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"]
    failing = []
    for case in root.iter("testcase"):
        for kind in ("failure", "error"):
            node = case.find(kind)
            if node is not None:
                message = (node.get("message") or node.text or "").strip().splitlines()
                failing.append({"test": f"{case.get('classname')}::{case.get('name')}", "kind": kind,
                                "message": (message[0] if message else "")[:400]})
    counts["failing"] = failing[:60]
    counts["failing_total"] = len(failing)
    counts["pytest_seconds"] = round(sum(float(s.get("time", 0)) for s in suites), 1)
    return counts


def sanitizer_details(log):
    if not log.is_file():
        return {}
    text = log.read_text(errors="replace")
    found = re.findall(r"ERROR SUMMARY: (\d+) error", text)
    cases = re.findall(r"(\d+) of (\d+) cases ok", text)
    details = {"sanitizer_errors": int(found[-1]) if found else None}
    if cases:
        details["cases_ok"], details["cases"] = int(cases[-1][0]), int(cases[-1][1])
    return details


def newest(out, pattern):
    files = sorted(Path(out).glob(pattern), key=lambda p: p.stat().st_mtime)
    return files[-1] if files else None


def bench_details(out):
    path = newest(out, "gpu-fwd-bwd*.json")
    if path is None:
        return {"result": None}
    rows = json.loads(path.read_text())["rows"]
    flare = [r for r in rows if r["impl"] == "flare" and r.get("vs_fa2") and "peak_mib" not in r]
    details = {"result": path.name, "rows": len(rows),
               "check_failed": sum(1 for r in rows if r.get("check_failed")),
               "skipped_rows": sum(1 for r in rows if r.get("skipped"))}
    if flare:
        worst = min(flare, key=lambda r: r["vs_fa2"])
        details.update(flare_rows=len(flare), flare_at_or_above_fa2=sum(r["vs_fa2"] >= 1.0 for r in flare),
                       worst_vs_fa2={k: worst[k] for k in ("pass", "headdim", "causal", "seqlen_q", "vs_fa2")})
    return details


def train_details(out):
    path = newest(out, "train*.json")
    if path is None:
        return {"result": None}
    data = json.loads(path.read_text())
    return {"result": path.name, "comparison": data.get("comparison"),
            "runs": [{k: r.get(k) for k in ("impl", "seqlen_q", "batch", "status", "ms", "peak_mib")}
                     for r in data["rows"]]}


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, required=True)
    p.add_argument("--command", default="tests/gpu/run.sh")
    p.add_argument("--started", type=int)
    args = p.parse_args()

    import torch
    sha, dirty = run_meta.git_commit()
    meta = {"commit": sha, "dirty": dirty, "date": run_meta.today(), "command": args.command,
            "started": datetime.datetime.fromtimestamp(args.started).isoformat(timespec="seconds")
            if args.started else None,
            "finished": datetime.datetime.now().isoformat(timespec="seconds"),
            "arch_path": os.environ.get("FLARE_CUDA_ARCH_PATH", "auto"),  # the CUDA forward path the run forced
            **run_meta.device_meta(torch), **run_meta.flare_meta()}
    stages = read_stages(args.work)
    for s in stages:
        if s["name"] == "tests":
            s.update(junit_details(args.out / "junit.xml"))
        elif s["name"].startswith("sanitize-"):
            s.update(sanitizer_details(args.work / f"{s['name']}.log"))
        elif s["name"] == "bench":
            s.update(bench_details(args.out))
        elif s["name"] == "train":
            s.update(train_details(args.out))
    ok = bool(stages) and all(s["status"] in ("passed", "skipped") for s in stages)
    summary = {"meta": meta, "ok": ok, "stages": stages}
    path = run_meta.default_result_path(args.out, "gpu-tests")
    path.write_text(json.dumps(summary, indent=1) + "\n")

    print(f"\n==== summary ({meta.get('device')}, commit {str(sha)[:12]}, {meta['date']}): "
          f"{'ALL OK' if ok else 'FAILURES'}")
    for s in stages:
        line = f"  {s['name']:<18} {s['status']:<8} {s['seconds']:>5} s"
        if s["name"] == "tests" and "tests" in s:
            line += (f"  {s['passed']} passed, {s['failures']} failed, {s['errors']} errors, "
                     f"{s['skipped']} skipped")
        elif s["name"] == "tests":
            line += f"  {s.get('junit')}"
        elif s["name"].startswith("sanitize-"):
            line += f"  sanitizer errors: {s.get('sanitizer_errors')}, cases ok: {s.get('cases_ok')}/{s.get('cases')}"
        elif s["name"] == "bench" and s.get("flare_rows"):
            line += (f"  flare >= FA2 on {s['flare_at_or_above_fa2']}/{s['flare_rows']} rows, worst "
                     f"{s['worst_vs_fa2']['vs_fa2']}x; accuracy failures {s['check_failed']}")
        elif s["name"] == "train" and s.get("comparison"):
            line += "  " + ", ".join(f"{k}: tracks={v.get('tracks')}" for k, v in s["comparison"].items())
        elif s["status"] == "skipped":
            line += f"  ({s['command']})"
        print(line)
    for s in stages:
        for f in s.get("failing", [])[:25]:
            print(f"  FAILED {f['test']}: {f['message'][:200]}")
    print(f"summary: {path}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
