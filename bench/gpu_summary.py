"""Summarise a `bench/gpu_check.sh` run: every benchmark's median and its ratio
to the reference of its group (pytest-benchmark JSON files), the GPU tests'
counts (JUnit XML) and the vLLM CUDA check (JSON), into OUT/results.csv (one
row per measurement) and OUT/summary.md.

    python bench/gpu_summary.py OUT
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

FIELDS = ["source", "group", "provider", "median_s", "ratio_to_reference", "rounds", "extra"]


def benchmark_rows(path: Path) -> list[dict]:
    """One row per benchmark of a pytest-benchmark JSON file, with the ratio of
    its median to its group's reference (extra_info.reference) when the group
    has one."""
    data = json.loads(path.read_text())
    benches = data.get("benchmarks", [])
    refs = {}
    for b in benches:
        if b.get("extra_info", {}).get("reference"):
            refs.setdefault(b.get("group") or b["name"], b["stats"]["median"])
    rows = []
    for b in benches:
        info = dict(b.get("extra_info", {}))
        group = b.get("group") or b["name"]
        med = b["stats"]["median"]
        ref = refs.get(group)
        rows.append(
            {
                "source": path.stem,
                "group": group,
                "provider": info.pop("provider", b["name"]),
                "median_s": f"{med:.6g}",
                "ratio_to_reference": f"{med / ref:.3f}" if ref else "",
                "rounds": b["stats"].get("rounds", ""),
                "extra": json.dumps({k: v for k, v in info.items() if k != "reference"}, sort_keys=True),
            }
        )
    return rows


def junit_counts(path: Path) -> dict[str, int]:
    """tests, failures, errors, skipped of a JUnit XML file (pytest --junitxml)."""
    root = ET.parse(path).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    out = {"tests": 0, "failures": 0, "errors": 0, "skipped": 0}
    for s in suites:
        for k in out:
            out[k] += int(s.get(k, 0))
    return out


def summarise(out: Path) -> tuple[list[dict], str]:
    """(CSV rows, markdown) for the files a gpu_check run left in `out`."""
    rows: list[dict] = []
    lines = ["# GPU check", ""]
    env = out / "env.txt"
    if env.is_file():
        lines += ["```", env.read_text().strip(), "```", ""]
    tests = out / "gpu_tests.xml"
    if tests.is_file():
        c = junit_counts(tests)
        passed = c["tests"] - c["failures"] - c["errors"] - c["skipped"]
        lines.append(
            f"GPU tests: {passed} passed, {c['failures']} failed, {c['errors']} errors, {c['skipped']} skipped"
        )
        rows.append({"source": "gpu_tests", "group": "pytest -m gpu", "provider": "counts", "extra": json.dumps(c)})
    else:
        lines.append("GPU tests: not run (no gpu_tests.xml)")
    for path in sorted(out.glob("bench_*.json")):
        try:
            got = benchmark_rows(path)
        except (ValueError, KeyError) as exc:  # a step stopped at its limit leaves an empty file
            lines += ["", f"## {path.stem}", "", f"no results: {path.name} is not a finished benchmark file ({exc})"]
            rows.append({"source": path.stem, "group": "unreadable", "provider": "", "extra": str(exc)})
            continue
        rows += got
        lines += ["", f"## {path.stem}", "", "| group | provider | median | x reference |", "|---|---|---|---|"]
        for r in got:
            lines.append(
                f"| {r['group']} | {r['provider']} | {float(r['median_s']) * 1e3:.3f} ms | {r['ratio_to_reference']} |"
            )
    vllm = out / "vllm_cuda.json"
    if vllm.is_file():
        v = json.loads(vllm.read_text())
        lines += ["", "## vLLM on CUDA", ""] + [f"- {k}: {v[k]}" for k in sorted(v)]
        rows.append({"source": "vllm_cuda", "group": "vLLM CUDA", "provider": "check", "extra": json.dumps(v)})
    steps = out / "steps.txt"
    if steps.is_file():
        lines += ["", "## Steps", "", "```", steps.read_text().strip(), "```"]
    return rows, "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("out", help="the directory gpu_check.sh wrote ($OUT)")
    args = ap.parse_args(argv)
    out = Path(args.out)
    if not out.is_dir():
        print(f"gpu_summary: out: {out} is not a directory", file=sys.stderr)
        return 2
    rows, md = summarise(out)
    with open(out / "results.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=FIELDS)
        w.writeheader()
        for r in rows:
            w.writerow({k: r.get(k, "") for k in FIELDS})
    (out / "summary.md").write_text(md)
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main())
