"""benchmarks/pair_trees.py: old code against new, as paired ratios. Its benchmarks take minutes a
run, so these check the parts that turn their output into the report, and one whole call over
a stand-in benchmark that prints what bench_efficiency.py prints."""

import json
import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), os.pardir, "benchmarks"))

import pair_trees  # noqa: E402


def test_the_parsers_read_every_measurement_the_benchmarks_print():
    eff = ("noise\nalgorithm=averaging network=mlp efficiency=0.843 efficiency_over_bound=0.870 x=1\n"
           "algorithm=sharing network=cnn efficiency=0.700 efficiency_over_bound=0.720\n")
    assert pair_trees._parse_efficiency(eff) == {
        "averaging-mlp efficiency": 0.843, "averaging-mlp efficiency_over_bound": 0.87,
        "sharing-cnn efficiency": 0.7, "sharing-cnn efficiency_over_bound": 0.72}
    par = "\n".join(json.dumps(r) for r in (
        {"algorithm": "averaging", "fused_steps": True, "efficiency": 0.9},
        {"algorithm": "averaging", "fused_steps": False, "efficiency": 0.8},
        {"algorithm": "sharing", "fused_steps": True, "efficiency": 0.7}))
    assert pair_trees._parse_parallel(par) == {"averaging-fused efficiency": 0.9, "averaging-unfused efficiency": 0.8,
                                               "sharing efficiency": 0.7}
    with pytest.raises(RuntimeError, match="printed no result line"):
        pair_trees._parse_efficiency("Traceback: nothing measured")


def test_the_bootstrap_interval_holds_the_median_and_narrows_with_agreeing_pairs():
    med, lo, hi = pair_trees.bootstrap_median([0.9, 1.0, 1.1, 1.0, 0.95, 1.05, 1.0, 0.98, 1.02])
    assert med == 1.0 and lo <= med <= hi and hi - lo < 0.1
    wide = pair_trees.bootstrap_median([0.5, 1.5, 0.6, 1.4, 1.0, 0.7, 1.3, 0.8, 1.2])
    assert wide[2] - wide[1] > hi - lo
    assert pair_trees.bootstrap_median([1.0] * 5) == (1.0, 1.0, 1.0)


def test_a_whole_call_alternates_the_trees_and_reports_the_paired_ratio(tmp_path, monkeypatch):
    # two stand-in trees whose "benchmark" prints a fixed efficiency: old 0.8, new 0.84
    for name, value in (("old", 0.8), ("new", 0.84)):
        bench = tmp_path / name / "benchmarks"
        bench.mkdir(parents=True)
        (bench / "bench_efficiency.py").write_text(
            f"print('algorithm=averaging network=mlp efficiency={value} efficiency_over_bound={value}')\n")
    out = tmp_path / "report.json"
    report = pair_trees.main(["--old", str(tmp_path / "old"), "--new", str(tmp_path / "new"), "--pairs", "3",
                              "--out", str(out), "efficiency", "averaging", "mlp"])
    assert [p["first"] for p in report["pairs"]] == ["old", "new", "old"]
    fig = report["figures"]["averaging-mlp efficiency"]
    assert np.allclose(fig["ratios"], [1.05] * 3) and fig["median_ratio"] == pytest.approx(1.05)
    assert json.loads(out.read_text())["tables"][0]["rows"][0][3] == "1.050 (1.050-1.050)"
