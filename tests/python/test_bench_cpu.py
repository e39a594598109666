"""The CPU benchmark's timing helper: flare's and torch's calls alternate, so a slow phase of a shared
machine is shared by both sides of a ratio."""
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench" / "cpu"))
sys.path.insert(0, str(ROOT / "bench"))

import bench_cpu  # noqa: E402


def test_calls_alternate_and_medians_are_per_callable(monkeypatch):
    clock = [0.0]
    order = []

    def fake_clock():
        return clock[0]

    def make(name, seconds):
        def call():
            order.append(name)
            clock[0] += seconds
        return call

    monkeypatch.setattr(bench_cpu.time, "perf_counter", fake_clock)
    ms, rounds = bench_cpu.time_interleaved_ms({"a": make("a", 0.010), "b": make("b", 0.030)},
                                               max_runs=50, budget_s=0.2)
    # Warm-up: one call each (0.04 s); 2 callables x 0.2 s budget / 0.04 s = 10 rounds.
    assert rounds == 10
    assert order == ["a", "b"] * (rounds + 1)
    assert abs(ms["a"] - 10.0) < 1e-9 and abs(ms["b"] - 30.0) < 1e-9


def test_rounds_stay_within_bounds(monkeypatch):
    clock = [0.0]

    def slow():
        clock[0] += 5.0

    monkeypatch.setattr(bench_cpu.time, "perf_counter", lambda: clock[0])
    _, rounds = bench_cpu.time_interleaved_ms({"x": slow, "y": slow}, max_runs=10, budget_s=1.0)
    assert rounds == 3  # at least three, however slow
    clock[0] = 0.0
    _, rounds = bench_cpu.time_interleaved_ms({"x": lambda: None, "y": lambda: None}, max_runs=7, budget_s=1.0)
    assert rounds == 7  # at most max_runs, however fast


def test_decode_bench_quick_smoke(tmp_path):
    """bench_decode.py end to end on tiny shapes: the accuracy gate, both implementations timed, the ceilings
    and the result file's rows."""
    import json

    import bench_decode

    lib = ROOT / "build" / "release" / "src" / "libflare.so"
    if not lib.is_file():
        import pytest
        pytest.skip(f"{lib} not built")
    out = bench_decode.main(["--quick", "--batches", "1", "--kv-lens", "96", "--dtypes", "bf16", "fp32",
                             "--lib", str(lib), "--out", str(tmp_path / "decode.json"), "--threads", "1"])
    doc = json.loads(out.read_text())
    assert doc["meta"]["ceilings"]["copy_tbps"] > 0
    rows = doc["rows"]
    assert {(r["impl"], r["dtype"]) for r in rows} == {(i, d) for i in ("flare", "torch-cpu") for d in ("bf16", "fp32")}
    assert all(r["pass"] == "decode" and r["tbps"] > 0 and r["nheads"] == 32 and r["nheads_k"] == 8 for r in rows)
    assert all(r["ms_after_peer"] > 0 and r["copy_ratio_after_peer"] > 0 and r["row_copy_tbps"] > 0 for r in rows)


def test_features_rounds_alternate_and_ratios_are_per_round(monkeypatch):
    """bench_features.py: the order within a round alternates, and a round's ratio is its own two calls'."""
    import bench_features

    clock = [0.0]
    order = []
    phase = iter([1.0, 1.0, 1.0, 1.0, 3.0, 3.0, 3.0, 3.0, 1.0, 1.0])  # a slow phase covering rounds 2 and 3

    def make(name, seconds):
        def call():
            order.append(name)
            clock[0] += seconds * next(phase, 1.0)
        return call

    monkeypatch.setattr(bench_features.time, "perf_counter", lambda: clock[0])
    a_ms, b_ms, ratios = bench_features.interleaved_ms(make("a", 0.010), make("b", 0.011), runs=4)
    assert order == ["a", "b", "a", "b", "b", "a", "a", "b", "b", "a"]  # warm-up, then a b, b a, a b, b a
    assert len(ratios) == 4 and all(abs(r - 1.1) < 1e-9 for r in ratios)  # the phase cancels within a round
    assert abs(a_ms - 20.0) < 1e-9 and abs(b_ms - 22.0) < 1e-9  # medians of (10, 30, 30, 10) and (11, 33, 33, 11)
    median, q1, q3 = bench_features.ratio_summary([1.0, 1.2, 1.1, 1.4, 0.9], scale=2.0)
    assert abs(median - 2.2) < 1e-9 and abs(q1 - 2.0) < 1e-9 and abs(q3 - 2.4) < 1e-9


def test_features_sweeps_split_the_rounds_and_continue_the_order(monkeypatch):
    """bench_features.py --sweeps: each sweep takes its share of the rounds, and a series that continues an
    earlier one (start) goes on alternating from where that one stopped; FaultCount keeps one count per call."""
    import bench_features

    assert bench_features.sweep_rounds(15, 5) == [3, 3, 3, 3, 3]
    assert bench_features.sweep_rounds(7, 3) == [3, 2, 2]
    assert bench_features.sweep_rounds(4, 1) == [4]
    order = []
    make = lambda name: lambda: order.append(name)  # noqa: E731
    ticks = iter(range(100))
    monkeypatch.setattr(bench_features.time, "perf_counter", lambda: float(next(ticks)))
    ta, tb, _ = bench_features.interleaved_rounds(make("a"), make("b"), 3, warm_up=False, start=3)
    assert order == ["b", "a", "a", "b", "b", "a"] and len(ta) == len(tb) == 3  # rounds 3, 4, 5: b a, a b, b a
    counted = bench_features.FaultCount(lambda: bytearray(8 << 20))  # 8 MiB, fresh pages
    counted(), counted()
    assert len(counted.faults) == 2 and all(f >= 0 for f in counted.faults) and max(counted.faults) > 0


def test_hd512_round_robin_smoke(tmp_path):
    """ab_hd512.py end to end on small shapes: every build's rows, the same library twice bitwise equal to
    itself, and the figures positive."""
    import json

    import ab_hd512

    lib = ROOT / "build" / "release" / "src" / "libflare.so"
    if not lib.is_file():
        import pytest
        pytest.skip(f"{lib} is not built (scripts/test.sh builds it first)")
    out = ab_hd512.main([f"a={lib}", f"b={lib}", "--commit", "a=0123abc", "--rounds", "2", "--threads", "1",
                         "--tokens", "256", "--seqlen", "128", "--dtypes", "fp32", "bf16",
                         "--out", str(tmp_path / "ab.json")])
    doc = json.loads(out.read_text())
    assert doc["meta"]["builds"]["a"] == {"path": str(lib), "commit": "0123abc"}
    rows = doc["rows"]
    assert {(r["dtype"], r["causal"], r["build"]) for r in rows} == {
        (d, c, b) for d in ("fp32", "bf16") for c in (False, True) for b in ("a", "b")}
    assert all(r["bitwise_equal"] and r["tflops_ratio"] > 0 and r["ms_256"] > 0 and r["ms_512"] > 0 for r in rows)
    assert all(r["speedup_256"] == 1.0 and r["speedup_512"] == 1.0 for r in rows if r["build"] == "a")
