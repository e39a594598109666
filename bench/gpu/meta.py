"""What every GPU result file says about its run (BENCH.md "Result files"): commit, date, device, command,
software versions. Shared by bench_gpu.py, train_llama.py and tests/gpu/summarize.py.

The commit comes from git when the tree is a checkout; a copy without .git (the GPU machine gets the working
tree, not the repository) takes it from FLARE_COMMIT, so a caller can pass the hash in:
    FLARE_COMMIT=$(git rev-parse HEAD) tests/gpu/run.sh ...
"""

import datetime
import os
import shlex
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def prefer_cuda_build():
    """FLARE_LIBRARY defaults to build/cuda/src/libflare.so when that build exists (python/flare/_capi.py's own
    search knows only the release build and the installed package)."""
    cuda_build = REPO / "build" / "cuda" / "src" / "libflare.so"
    if "FLARE_LIBRARY" not in os.environ and cuda_build.is_file():
        os.environ["FLARE_LIBRARY"] = str(cuda_build)


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
        return os.environ.get("FLARE_COMMIT", "unknown"), None


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


def flare_meta():
    """The loaded libflare: path, version, CUDA backend (or why it could not be loaded)."""
    sys.path.insert(0, str(REPO / "python"))
    try:
        import flare
        lib = flare.library()
        return {"flare_library": lib.path, "flare_version": lib.version(), "flare_has_cuda": lib.has_cuda()}
    except Exception as e:  # recorded: the summary must say why nothing ran
        return {"flare_library": None, "flare_error": f"{type(e).__name__}: {e}"}


def default_result_path(out_dir, topic, quick=False):
    """<out_dir>/<topic>[-quick]-<date>[-N].json, never overwriting an earlier file of the same day."""
    out_dir = Path(out_dir)
    name = f"{topic}-quick" if quick else topic
    path = out_dir / f"{name}-{today()}.json"
    n = 2
    while path.exists():
        path = out_dir / f"{name}-{today()}-{n}.json"
        n += 1
    return path
