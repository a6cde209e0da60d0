"""`make gpu-check`: one command that proves the CUDA path on a lent GPU machine within its time budget and writes
OUT/gpu-check.json and OUT/gpu-check.log. DEVICE=cpu runs the same steps on tiny shapes (the dry run CI keeps alive).

Each step is timed and its failure recorded without stopping the rest; a step that would overrun the budget is skipped.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import platform
import subprocess
import sys
import time
import traceback
import xml.etree.ElementTree as ET
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# wheels that travel with the working tree (docs/gpu-check.md: the carry recipe; bench/carry_wheels.py makes them)
CARRY = Path(os.environ.get("SPECRUN_CARRY", REPO / ".whl"))
SITE = Path("/tmp/specrun-site")  # where the carried wheels are installed on the machine
GPU_TESTS = ["tests/decoding/test_gpu.py", "tests/decoding/test_sampling.py", "tests/decoding/test_attention.py",
             "tests/decoding/test_several_sequences.py", "tests/decoding/test_quant_draft.py",
             "tests/decoding/test_quant_static.py"]

ALL = ("build", "bandwidth", "decode", "verify", "engine", "batch", "quant")
SPEC = ("build", "engine", "batch")  # a cycle model: speculation's upper bound (its text is drafted whole)


def _model(shape: str, contexts=(), flashinfer: bool = False, cycle: int = 0, measures=ALL) -> dict:
    return dict(shape=shape, contexts=list(contexts), flashinfer=flashinfer, cycle=cycle, measures=measures)


# per device: the models, dtype and sizes each step uses; the budget in seconds (a 15-minute loan: ~0.5 min to start
# the machine, this check, and time to run it once more)
PLANS = {
    "cuda": dict(budget=420, dtype="bfloat16", tests_timeout=150, models={
        "llama-3.1-8b": _model("llama-3.1-8b", [1024, 16384, 65536], flashinfer=True),
        "llama-3.2-1b": _model("llama-3.2-1b", [1024, 16384, 65536, 100000]),
        "llama-3.1-8b-cycle": _model("llama-3.1-8b", flashinfer=True, cycle=16, measures=SPEC)},
        steps=20, widths=[1, 2, 4, 8, 16, 32, 64], levels=[1, 8, 32], prompt_len=256, new_tokens=64,
        engine_prompt=1024, engine_tokens=256),
    "cpu": dict(budget=120, dtype="float32", tests_timeout=90, models={
        "tiny-a": _model("tiny-a", [64, 4200], flashinfer=True), "tiny-b": _model("tiny-b", [64, 300]),
        "tiny-a-cycle": _model("tiny-a", flashinfer=True, cycle=5, measures=SPEC)},
        steps=3, widths=[1, 4, 16], levels=[1, 2], prompt_len=32, new_tokens=12, engine_prompt=32, engine_tokens=12),
}


class Check:
    """The report under construction: steps in order, each {ok, seconds, error?, result?}; written after each step."""

    def __init__(self, out: Path, device: str, budget: float):
        self.out, self.t0, self.budget = out, time.monotonic(), budget
        started = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self.report = {"device": device, "budget_s": budget, "started": started,
                       "steps": {}}
        out.mkdir(parents=True, exist_ok=True)
        self.log_file = open(out / "gpu-check.log", "a", encoding="utf-8")

    def log(self, msg: str) -> None:
        line = f"[{time.monotonic() - self.t0:7.1f}s] {msg}"
        print(line, flush=True)
        self.log_file.write(line + "\n")
        self.log_file.flush()

    def left(self) -> float:
        return self.budget - (time.monotonic() - self.t0)

    def step(self, name: str, fn, need: float = 0.0):
        """Run fn() as step `name` unless less than `need` seconds of the budget are left; record what happened."""
        if self.left() < need:
            why = f"{self.left():.0f} s left of the budget, needs ~{need:.0f}"
            self.report["steps"][name] = {"ok": False, "skipped": why}
            self.log(f"{name}: skipped (budget)")
            return None
        self.log(f"{name}: start")
        t = time.monotonic()
        entry = {"ok": True}
        try:
            entry["result"] = fn()
        except Exception as e:  # noqa: BLE001 (every failure is a finding; the next step still runs)
            entry.update(ok=False, error=f"{type(e).__name__}: {e}", traceback=traceback.format_exc()[-4000:])
        entry["seconds"] = round(time.monotonic() - t, 2)
        self.report["steps"][name] = entry
        self.log(f"{name}: {'ok' if entry['ok'] else 'FAILED ' + entry['error'][:300]} in {entry['seconds']} s")
        self.write()
        return entry.get("result")

    def write(self) -> None:
        self.report["elapsed_s"] = round(time.monotonic() - self.t0, 1)
        tmp = self.out / "gpu-check.json.tmp"
        tmp.write_text(json.dumps(self.report, indent=1, default=str))
        os.replace(tmp, self.out / "gpu-check.json")


def install_carried() -> dict:
    """Install the wheels under .whl (if any) into SITE, without the network, and put SITE on the import path."""
    wheels = sorted(glob.glob(str(CARRY / "*.whl")))
    if wheels:
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                        "--no-cache-dir", "--upgrade", "--target", str(SITE), *wheels], check=True,
                       capture_output=True, text=True, timeout=120)
        sys.path.insert(0, str(SITE))
        os.environ["PYTHONPATH"] = os.pathsep.join([str(SITE), str(REPO), os.environ.get("PYTHONPATH", "")])
    return {"wheels": [Path(w).name for w in wheels]}


def environment(device: str) -> dict:
    """Versions, the card, and which of flashinfer / torch.compile / CUDA graphs are there."""
    import torch
    import transformers

    env = {"python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "cuda": torch.version.cuda, "cuda_available": torch.cuda.is_available()}
    if device == "cuda":
        p = torch.cuda.get_device_properties(0)
        env.update(card=p.name, memory_gib=round(p.total_memory / 2**30, 1), sms=p.multi_processor_count,
                   capability=f"{p.major}.{p.minor}", driver_cuda=torch.cuda.driver_version()
                   if hasattr(torch.cuda, "driver_version") else None)
        # flashinfer compiles its kernels at first use: for this card only, on every core
        os.environ.setdefault("FLASHINFER_CUDA_ARCH_LIST", f"{p.major}.{p.minor}" + ("a" if p.major == 9 else ""))
        os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 4))
    try:
        import flashinfer
        env["flashinfer"] = flashinfer.__version__
    except Exception as e:  # noqa: BLE001 (ImportError, or a broken install: both mean not available)
        env["flashinfer"] = None
        env["flashinfer_error"] = f"{type(e).__name__}: {e}"[:300]
    try:
        import triton
        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    env["torch_compile"] = hasattr(torch, "compile")
    env["cuda_graphs"] = device == "cuda" and _graph_works()
    return env


def _graph_works() -> bool:
    import torch

    x = torch.ones(4, device="cuda")
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        y = x * 2
    x.fill_(3)
    g.replay()
    return bool((y == 6).all())


def run_tests(device: str, out: Path, timeout: float) -> dict:
    """The gpu-marked tests in a subprocess (on CPU every one of them skips: the dry run checks the plumbing)."""
    xml = out / "pytest-gpu.xml"
    cmd = [sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider", "-rfEs",
           f"--junitxml={xml}", *GPU_TESTS]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    try:
        proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        said = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        (out / "pytest-gpu.log").write_text(said)
        raise RuntimeError(f"pytest ran past {timeout} s; its output so far ends: {said[-1500:]}") from None
    (out / "pytest-gpu.log").write_text(proc.stdout + proc.stderr)
    counts, failed = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}, []
    if xml.exists():
        for suite in ET.parse(xml).getroot().iter("testsuite"):
            for k in counts:
                counts[k] += int(suite.get(k, 0))
        for case in ET.parse(xml).getroot().iter("testcase"):
            bad = case.find("failure") if case.find("failure") is not None else case.find("error")
            if bad is not None:
                failed.append({"test": f"{case.get('classname')}::{case.get('name')}",
                               "message": (bad.get("message") or "")[:500]})
    if proc.returncode not in (0, 5) or failed:
        raise RuntimeError(f"pytest exit {proc.returncode}: {counts}, failed {[f['test'] for f in failed]}; "
                           f"tail: {proc.stdout[-1500:]}")
    return {**counts, "passed": counts["tests"] - counts["failures"] - counts["errors"] - counts["skipped"],
            "exit": proc.returncode}


def bench_model(check: Check, name: str, spec: dict, plan: dict, device: str, have_flashinfer: bool) -> None:
    """The measurements spec names for one model, each its own step (the model is built once, then freed)."""
    import torch

    from specrun.bench import device_bench as db
    from specrun.bench.roofline import read_bandwidth

    dtype = getattr(torch, plan["dtype"])
    lm = check.step(f"{name}/build", lambda: db.random_model(spec["shape"], dtype, device, spec["cycle"]), need=20)
    if lm is None:
        return
    check.report["steps"][f"{name}/build"]["result"] = {"parameters": sum(p.numel() for p in lm.model.parameters())}
    todo, bw = spec["measures"], None
    if "bandwidth" in todo:
        mb = 1024 if device == "cuda" else 64
        bw = check.step(f"{name}/bandwidth", lambda: read_bandwidth(lm.device, megabytes=mb))
    if "decode" in todo:
        check.step(f"{name}/decode", lambda: db.decode_rates(lm, spec["contexts"], plan["steps"], bw), need=15)
    if "verify" in todo:
        check.step(f"{name}/verify", lambda: [row for c in spec["contexts"] for row in db.verify_costs(
            lm, c, plan["widths"] if c == spec["contexts"][0] else plan["widths"][::2], plan["steps"])], need=10)
    if "engine" in todo:
        check.step(f"{name}/engine", lambda: db.engine_rates(lm, plan["engine_prompt"], plan["engine_tokens"]), need=20)
    if "batch" in todo:
        fi = spec["flashinfer"] and have_flashinfer
        # a cycle model's batches on flashinfer alone where it is there (the backend a GPU job runs)
        backends = (["flashinfer"] if spec["cycle"] else ["sdpa", "flashinfer"]) if fi else ["sdpa"]
        check.step(f"{name}/batch", lambda: db.batch_rates(lm, plan["levels"], plan["prompt_len"], plan["new_tokens"],
                                                           backends), need=30)
    if "quant" in todo:  # last: the 4-bit copy's memory beside the model's
        check.step(f"{name}/quant", lambda: db.quant_draft_rates(lm, plan["engine_prompt"], plan["engine_tokens"] // 2),
                   need=30)
    lm = None  # the next model gets the memory back
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=sorted(PLANS), default="cuda")
    ap.add_argument("--out", type=Path, required=True, help="Folder for gpu-check.json, the log and pytest's report.")
    ap.add_argument("--budget", type=float, help="Seconds for the whole check (default: the device's plan).")
    ap.add_argument("--skip-tests", action="store_true", help="Leave out the gpu-marked tests.")
    ap.add_argument("--models", help="Comma list of the plan's models to measure (default: all).")
    args = ap.parse_args(argv)
    plan = PLANS[args.device]
    models = plan["models"]
    if args.models:
        unknown = sorted(set(args.models.split(",")) - set(models))
        if unknown:
            ap.error(f"unknown model {unknown[0]!r} for --device {args.device}; choose from {', '.join(models)}")
        models = {k: v for k, v in models.items() if k in args.models.split(",")}
    check = Check(args.out, args.device, args.budget or plan["budget"])
    check.step("carry", install_carried)
    env = check.step("environment", lambda: environment(args.device)) or {}
    if args.device == "cuda" and not env.get("cuda_available"):
        check.log("no CUDA device: stopping")
        check.write()
        return 1
    if not args.skip_tests:
        check.step("tests", lambda: run_tests(args.device, args.out, plan["tests_timeout"]), need=30)
    for name, spec in models.items():
        try:
            bench_model(check, name, spec, plan, args.device, bool(env.get("flashinfer")))
        except Exception as e:  # noqa: BLE001 (a fault between steps: recorded, the next model still runs)
            check.report["steps"][f"{name}/error"] = {"ok": False, "error": f"{type(e).__name__}: {e}"}
            check.log(f"{name}: FAILED between steps: {e}")
    check.write()
    failed = [k for k, v in check.report["steps"].items() if not v["ok"]]
    check.log(f"done in {check.report['elapsed_s']} s; failed or skipped: {failed or 'none'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
