"""What every result file says about its run, and how it is named and written (bench/README.md): commit,
date, device, command and software versions; the machine's ceilings; the file's name; its JSON. The one
copy for the CPU and GPU benches, tests/gpu/summarize.py (through bench/gpu/meta.py) and
scripts/check-results.py (the naming rule).

The commit comes from git when the tree is a checkout; a copy without .git (the GPU machine gets the working
tree, not the repository) takes it from FLARE_COMMIT, so a caller can pass the hash in:
    FLARE_COMMIT=$(git rev-parse HEAD) tests/gpu/run.sh ...
"""

import datetime
import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "bench" / "results"

# <topic>-<date>-<short sha>.json, and -2, -3 ... after it for a second run of one commit on one day.
RESULT_NAME = re.compile(r"^(?P<topic>[a-z][a-z0-9]*(?:-[a-z0-9]+)*?)-(?P<date>\d{4}-\d{2}-\d{2})"
                         r"-(?P<sha>[0-9a-f]{7})(?:-(?P<n>[2-9]|[1-9]\d+))?\.json$")


# ---- provenance: commit, date, command -------------------------------------------------------------------


def git_commit():
    """(sha, dirty): FLARE_COMMIT when set (the GPU machine's copy of the tree may carry a stale .git, so the
    caller's word wins; dirty unknown: None), else git's answer, else ("unknown", None)."""
    if os.environ.get("FLARE_COMMIT"):
        return os.environ["FLARE_COMMIT"], None
    try:
        sha = subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"], capture_output=True, text=True,
                             check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(REPO), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, check=True).stdout.strip() != ""
        return sha, dirty
    except (OSError, subprocess.CalledProcessError):
        return "unknown", None


def short_sha(commit):
    """The 7-character hash at the start of a commit field ("abc1234def..." or "abc1234 (more words)"), or
    None when it does not start with one."""
    head = str(commit or "").split(" ", 1)[0]
    return head[:7] if re.fullmatch(r"[0-9a-f]{7,40}", head) else None


def commit_text(meta):
    """The commit of a result's meta for a table: the hash cut to 12 characters, and any words after it (FLARE_COMMIT
    may say more, e.g. "abc1234 (CPU sources: uncommitted work in progress)")."""
    sha, _, rest = str(meta.get("commit", "?")).partition(" ")
    return sha[:12] + (f" {rest}" if rest else "")


def today():
    return datetime.date.today().isoformat()


def command_line(script):
    """How to rerun this process: python3 <script relative to the repo> <its arguments>."""
    try:
        rel = Path(script).resolve().relative_to(REPO)
    except ValueError:
        rel = Path(script)
    return " ".join(["python3", str(rel)] + [shlex.quote(a) for a in sys.argv[1:]])


def provenance(script):
    """The fields every result's meta starts with: commit, dirty, date, command."""
    sha, dirty = git_commit()
    return {"commit": sha, "dirty": dirty, "date": today(), "command": command_line(script)}


# ---- device and software -------------------------------------------------------------------------------


def cpu_description():
    """'<model name> (family F model M), N cores': virtual machines often mask the model name ("AMD EPYC"),
    and the family and model tell the generations apart (AMD family 25 is Zen 3/4, 26 Zen 5)."""
    fields = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("model name", "cpu family", "model") and key not in fields:
                    fields[key] = value.strip()
                if not line.strip() and fields:
                    break
    except OSError:
        pass
    name = fields.get("model name", "unknown CPU")
    if "cpu family" in fields and "model" in fields:
        name += f" (family {fields['cpu family']} model {fields['model']})"
    return f"{name}, {os.cpu_count()} cores"


def device_meta(torch):
    """Device and software fields; works without a GPU (device "cpu")."""
    meta = {"torch": torch.__version__, "python": sys.version.split()[0]}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        meta.update(device=torch.cuda.get_device_name(0), cuda=torch.version.cuda,
                    capability=f"{props.major}.{props.minor}", sm_count=props.multi_processor_count,
                    memory_gib=round(props.total_memory / 2 ** 30, 1))
        try:
            meta["cudnn"] = torch.backends.cudnn.version()
        except Exception:  # cuDNN missing is a fact to record, not a failure
            meta["cudnn"] = None
        try:
            smi = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                 capture_output=True, text=True, timeout=20)
            meta["driver"] = smi.stdout.strip().splitlines()[0] if smi.returncode == 0 and smi.stdout else None
        except (OSError, subprocess.TimeoutExpired):
            meta["driver"] = None
    else:
        meta["device"] = "cpu (no CUDA device)"
    try:
        import triton
        meta["triton"] = triton.__version__
    except ImportError:
        pass
    return meta


def prefer_cuda_build():
    """FLARE_LIBRARY defaults to build/cuda/src/libflare.so when that build exists (python/flare/_capi.py's own
    search knows only the release build and the installed package)."""
    cuda_build = REPO / "build" / "cuda" / "src" / "libflare.so"
    if "FLARE_LIBRARY" not in os.environ and cuda_build.is_file():
        os.environ["FLARE_LIBRARY"] = str(cuda_build)


def flare_meta():
    """The loaded libflare: path, version, CUDA backend (or why it could not be loaded)."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        import flare
        lib = flare.library()
        return {"flare_library": lib.path, "flare_version": lib.version(), "flare_has_cuda": lib.has_cuda()}
    except Exception as e:  # recorded: the summary must say why nothing ran
        return {"flare_library": None, "flare_error": f"{type(e).__name__}: {e}"}


# ---- ceilings ----------------------------------------------------------------------------------------------


def fma_ceilings(fma_peak):
    """This CPU's arithmetic ceilings from tools/fma_peak (built with the library), GFLOP/s on all cores:
    fma_fp32_gflops, fma_fp32_avx2_gflops, dpbf16_gflops, amx_bf16_gflops where the processor has them."""
    if not Path(fma_peak).is_file():
        print(f"note: {fma_peak} not found (build the fma_peak target); ceilings left out", file=sys.stderr)
        return {}
    result = subprocess.run([str(fma_peak), "--json"], capture_output=True, text=True, check=True)
    ceilings = json.loads(result.stdout)
    ceilings.pop("threads", None)
    return ceilings


def ceiling_gflops(ceilings, dtype):
    """The ceiling a dtype's products run against, GFLOP/s: on the GPU the run's bf16 matmul; on the CPU the
    fp32 FMA for fp32, AMX (else vdpbf16ps) for bf16. None when the run recorded none."""
    if ceilings.get("matmul_bf16_tflops"):
        return ceilings["matmul_bf16_tflops"] * 1e3
    if dtype == "fp32":
        return ceilings.get("fma_fp32_gflops")
    return ceilings.get("amx_bf16_gflops") or ceilings.get("dpbf16_gflops")


# ---- the result file -------------------------------------------------------------------------------------


def result_name(topic, commit, date=None, quick=False):
    """<topic>[-quick]-<date>-<short sha>.json (bench/README.md); "unknown" stands for a missing hash, a name
    scripts/check-results.py then refuses in bench/results."""
    name = f"{topic}-quick" if quick else topic
    return f"{name}-{date or today()}-{short_sha(commit) or 'unknown'}.json"


def default_result_path(out_dir, topic, quick=False):
    """out_dir/result_name(...) for this tree's commit; a second run of the same commit on the same day gets
    -2, -3, ... before .json, so no earlier file is overwritten."""
    sha, _ = git_commit()
    path = Path(out_dir) / result_name(topic, sha, quick=quick)
    n = 2
    while path.exists():
        path = path.with_name(f"{result_name(topic, sha, quick=quick)[:-len('.json')]}-{n}.json")
        n += 1
    return path


def write_result(path, doc):
    """Writes a result document as JSON (one space of indent, a final newline). A file already in bench/results
    is never rewritten: results are records."""
    path = Path(path)
    if path.exists() and path.resolve().parent == RESULTS.resolve():
        sys.exit(f"{path} exists: result files in bench/results are never rewritten")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=1) + "\n")
    return path
