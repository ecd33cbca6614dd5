"""Benchmark configuration: after the run, print for each group every
provider's median, spread, throughput and ratio to the group's reference
provider, all measured in this same run.

Each benchmark sets extra_info: "provider", "reference" (True for the one the
ratios are taken against), "floor" (True for each way of timing the group's
products alone; the fastest of them is the group's floor, and every provider's
ratio to it is printed too), and "bytes" or "flops" for the throughput column.
The header and the summary name the CPU, its cores, and the product backends
(torch.mm/MKL, oneDNN) with what resident_trainer.ops._gemm chose per shape.
"""

import os
import platform
import subprocess

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def machine() -> str:
    """The CPU model (lscpu's model name), its cores, and torch's threads."""
    model = platform.processor() or "unknown CPU"
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        model = next(
            (line.split(":", 1)[1].strip() for line in out.splitlines() if line.startswith("Model name")), model
        )
    except (OSError, subprocess.SubprocessError):
        pass
    return f"{model}, {os.cpu_count()} cores, torch {torch.__version__} with {torch.get_num_threads()} threads"


def gemm() -> str:
    """MKL and oneDNN availability, the RESIDENT_TRAINER_GEMM setting, the
    backend chosen (with both measured times) for each shape class so far, the
    added expert's measured CPU path (kernel or composition) per class, and the
    linear cross-entropy's measured vocabulary tiles per class."""
    from resident_trainer.ops import _gemm, added_expert
    from resident_trainer.ops import linear_cross_entropy as lce

    return "\n".join([_gemm.backend_report(), added_expert.path_report(), lce.tile_report()])


def pytest_report_header(config):
    return [f"machine: {machine()}", gemm()]


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    if session is None or not session.benchmarks:
        return
    groups = {}
    for b in session.benchmarks:
        groups.setdefault(b.group or b.name, []).append(b)
    tr = terminalreporter
    tr.section("ratios to the reference, measured in this run (median; lower time is better)")
    tr.write_line(f"machine: {machine()}")
    tr.write_line(gemm())
    for group, benches in groups.items():
        # A benchmark whose call raised has no timings: named, not ranked.
        failed = [b for b in benches if not b.stats.data]
        benches = [b for b in benches if b.stats.data]
        ref = next((b for b in benches if b.extra_info.get("reference")), None)
        floors = [b for b in benches if b.extra_info.get("floor")]
        floor = min(floors, key=lambda b: b.stats.median) if floors else None
        tr.write_line(f"\n{group}" + (f"  (floor: {floor.extra_info.get('provider')})" if floor else ""))
        for b in sorted(benches, key=lambda b: b.stats.median):
            med = b.stats.median
            info = b.extra_info
            rate = ""
            if "bytes" in info:
                rate = f"{info['bytes'] / med / 1e9:8.1f} GB/s"
            elif "flops" in info:
                rate = f"{info['flops'] / med / 1e12:8.3f} TFLOP/s"
            ratio = f"{med / ref.stats.median:6.2f}x time of ref" if ref is not None else ""
            if floor is not None:
                ratio += f"  {med / floor.stats.median:6.2f}x time of floor"
            extra = "  ".join(
                f"{k}={v}"
                for k, v in info.items()
                if k not in ("provider", "reference", "floor", "bytes", "flops", "interleaved")
            )
            tr.write_line(
                f"  {info.get('provider', b.name):34s} {med * 1e3:10.3f} ms  iqr {b.stats.iqr * 1e3:8.3f} ms  {rate}  {ratio}  {extra}"
            )
            # Providers run in rotation within each round (bench_added_expert's interleaved test).
            for row in info.get("interleaved", []):
                floor_ratio = "" if row["vs_floor"] is None else f"  {row['vs_floor']:6.2f}x time of floor"
                tr.write_line(
                    f"    {row['provider']:40s} {row['median_s'] * 1e3:10.3f} ms  {row['vs_reference']:6.2f}x time of ref"
                    f" (per round {row['vs_reference_paired']:.2f}x){floor_ratio}"
                )
        for b in failed:
            tr.write_line(f"  {b.extra_info.get('provider', b.name):34s} no timings (the call raised)")
