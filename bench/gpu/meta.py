"""bench/meta.py under the name tests/gpu/summarize.py imports (it puts bench/gpu, not bench, on sys.path).
Everything is defined there; this file only loads it."""

import importlib.util
from pathlib import Path

_spec = importlib.util.spec_from_file_location("bench_meta", Path(__file__).resolve().parents[1] / "meta.py")
_module = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_module)
globals().update({name: value for name, value in vars(_module).items() if not name.startswith("__")})
