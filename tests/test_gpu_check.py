"""The CPU-side parts of bench/gpu_check.sh: its arguments, what it leaves on
a machine without a GPU, and the summary (bench/gpu_summary.py) of a run's
files."""

from __future__ import annotations

import csv
import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_check.sh"


def _summary_module():
    spec = importlib.util.spec_from_file_location("gpu_summary", ROOT / "bench" / "gpu_summary.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _run(*args, **env):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHON": sys.executable, **env})  # fmt: skip


def test_help_and_bad_arguments(tmp_path):
    r = _run("--help")
    assert r.returncode == 0 and "bash bench/gpu_check.sh [OUT]" in r.stdout and "vllm_cuda.json" in r.stdout
    r = _run("--fast")
    assert r.returncode == 2 and "unknown option --fast" in r.stderr
    blocked = tmp_path / "file"
    blocked.write_text("")
    r = _run(str(blocked / "out"))
    assert r.returncode == 2 and "OUT: cannot write" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="what the script does without a GPU")
def test_without_a_gpu_it_says_so_and_still_writes_the_summary(tmp_path):
    out = tmp_path / "out"
    r = _run(str(out))
    assert r.returncode == 1
    assert "torch" in (out / "env.txt").read_text()
    assert "no CUDA device" in (out / "steps.txt").read_text()
    md = (out / "summary.md").read_text()
    assert md.startswith("# GPU check") and "GPU tests: not run" in md
    assert (out / "results.csv").read_text().startswith("source,group,provider")


def _bench_json(path: Path, group: str, medians: dict[str, float], reference: str) -> None:
    benches = [
        {"name": f"test[{p}]", "group": group, "stats": {"median": m, "rounds": 5},
         "extra_info": {"provider": p, "reference": p == reference, "bytes": 1024}}
        for p, m in medians.items()
    ]  # fmt: skip
    path.write_text(json.dumps({"benchmarks": benches}))


def test_summary_of_a_run(tmp_path):
    mod = _summary_module()
    _bench_json(tmp_path / "bench_linear_cross_entropy.json", "N=8192", {"eager": 0.02, "ours": 0.005, "cce": 0.01},
                "eager")  # fmt: skip
    (tmp_path / "gpu_tests.xml").write_text(
        '<testsuites><testsuite tests="10" failures="1" errors="0" skipped="2"/></testsuites>'
    )
    (tmp_path / "vllm_cuda.json").write_text(json.dumps({"zero_block_equals_plain": True, "recalled": 2}))
    (tmp_path / "steps.txt").write_text("build      passed   12s\n")
    assert mod.main([str(tmp_path)]) == 0
    rows = list(csv.DictReader((tmp_path / "results.csv").read_text().splitlines()))
    ratios = {r["provider"]: r["ratio_to_reference"] for r in rows if r["source"] == "bench_linear_cross_entropy"}
    assert ratios == {"eager": "1.000", "ours": "0.250", "cce": "0.500"}
    assert json.loads(next(r for r in rows if r["source"] == "gpu_tests")["extra"])["failures"] == 1
    md = (tmp_path / "summary.md").read_text()
    assert "GPU tests: 7 passed, 1 failed, 0 errors, 2 skipped" in md
    assert "| N=8192 | ours | 5.000 ms | 0.250 |" in md and "- recalled: 2" in md and "build      passed" in md
    assert mod.main([str(tmp_path / "missing")]) == 2


def test_summary_names_a_benchmark_file_a_timed_out_step_left_empty(tmp_path):
    # A step stopped at its limit leaves pytest-benchmark's JSON file empty.
    mod = _summary_module()
    (tmp_path / "bench_linear_cross_entropy.json").write_text("")
    _bench_json(tmp_path / "bench_fingerprint.json", "512 MiB", {"sum": 0.002, "ours": 0.001}, "sum")
    assert mod.main([str(tmp_path)]) == 0
    md = (tmp_path / "summary.md").read_text()
    assert "no results: bench_linear_cross_entropy.json is not a finished benchmark file" in md
    assert "| 512 MiB | ours | 1.000 ms | 0.500 |" in md
