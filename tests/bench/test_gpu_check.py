"""`make gpu-check DEVICE=cpu`: the GPU check's dry run on tiny shapes writes the report a lent machine would."""

import json
import os
import subprocess
import sys
from pathlib import Path

from specrun.bench import gpu_check

REPO = Path(__file__).resolve().parents[2]


def test_dry_run_writes_every_step(tmp_path):
    out = tmp_path / "out"
    # a budget no busy host reaches: on CI the dry run checks the steps, not their speed
    proc = subprocess.run(["make", "-s", "gpu-check", "DEVICE=cpu", f"OUT={out}", f"PYTHON={sys.executable}",
                           "BUDGET=3600"],
                          cwd=REPO, capture_output=True, text=True, timeout=300,
                          env={**os.environ, "SPECRUN_CARRY": str(tmp_path / "no-wheels")})  # none carried here
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((out / "gpu-check.json").read_text())
    steps = report["steps"]
    models = gpu_check.PLANS["cpu"]["models"]
    shapes = list(models)
    measured = [f"{s}/{m}" for s in shapes for m in models[s]["measures"]]
    assert list(steps) == ["carry", "environment", "tests"] + measured
    cycle = [s for s in shapes if models[s]["cycle"]]
    assert cycle and all(r["mean_accepted"] > 1 for r in steps[f"{cycle[0]}/batch"]["result"] if r["name"] == "spec")
    assert all(v["ok"] for v in steps.values()), {k: v.get("error") for k, v in steps.items()}
    assert steps["tests"]["result"]["tests"] > 0 and steps["tests"]["result"]["failures"] == 0  # collected, ran none
    decode = steps[f"{shapes[0]}/decode"]["result"]
    assert [row["context"] for row in decode] == gpu_check.PLANS["cpu"]["models"][shapes[0]]["contexts"]
    assert all(row["eager_ms"] > 0 and row["static_ms"] > 0 and 0 < row["eager_roofline_share"] for row in decode)
    verify, widths = steps[f"{shapes[0]}/verify"]["result"], gpu_check.PLANS["cpu"]["widths"]
    first, *later = gpu_check.PLANS["cpu"]["models"][shapes[0]]["contexts"]
    assert [(r["context"], r["width"]) for r in verify] == [(first, w) for w in widths] + [
        (c, w) for c in later for w in widths[::2]]
    assert all(r["ms"] > 0 and r["static_ms"] > 0 for r in verify)
    engine = {r["name"]: r for r in steps[f"{shapes[0]}/engine"]["result"]}
    assert all(engine[n]["equal_to_ar_eager"] for n in ("ar_static", "spec_eager", "spec"))  # float32 on CPU: exact
    batch = steps[f"{shapes[0]}/batch"]["result"]
    assert {(r["concurrency"], r["name"]) for r in batch} == {(c, n) for c in gpu_check.PLANS["cpu"]["levels"]
                                                              for n in ("ar", "spec")}
    quant = {r["name"]: r for r in steps[f"{shapes[0]}/quant"]["result"]}  # the 4-bit self-draft on the device
    assert quant["spec_quant"]["equal_to_ar"] and quant["spec_quant"]["draft_ms_per_node"] > 0
    assert quant["spec_quant_eager"]["equal_to_ar"] and quant["spec_quant_eager"]["draft_ms_per_node"] > 0  # no twin
    assert "gpu-check.log" in {p.name for p in out.iterdir()}


def test_a_failing_step_is_recorded_and_the_rest_still_run(tmp_path, monkeypatch):
    from specrun.bench import device_bench

    def broken(*a, **k):
        raise RuntimeError("verify broke")

    monkeypatch.setattr(device_bench, "verify_costs", broken)
    monkeypatch.setattr(gpu_check, "CARRY", tmp_path / "no-wheels")
    code = gpu_check.main(["--device", "cpu", "--out", str(tmp_path), "--skip-tests", "--budget", "3600"])
    steps = json.loads((tmp_path / "gpu-check.json").read_text())["steps"]
    assert code == 1
    for shape, spec in gpu_check.PLANS["cpu"]["models"].items():
        if "verify" not in spec["measures"]:
            continue
        assert steps[f"{shape}/verify"]["ok"] is False and "verify broke" in steps[f"{shape}/verify"]["error"]
        assert steps[f"{shape}/engine"]["ok"] and steps[f"{shape}/batch"]["ok"]


def test_a_step_past_the_budget_is_skipped_not_run(tmp_path):
    ran = []
    check = gpu_check.Check(tmp_path, "cpu", budget=5)
    check.step("cheap", lambda: ran.append("cheap"))
    check.step("dear", lambda: ran.append("dear"), need=60)
    assert ran == ["cheap"]
    assert "skipped" in check.report["steps"]["dear"] and check.report["steps"]["dear"]["ok"] is False
