"""Plot a teaching run job by job: facts recalled, held-out rewordings and
controls kept identical after each job, against the facts taught so far.

    resident-trainer teach FACTS.jsonl --jobs K --score-each-job --report OUT.json
    python bench/plot_jobs.py OUT.json PLOT.png [--title TEXT]

The report must come from `--score-each-job` (each job's record carries its
summary). Needs matplotlib (`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def job_rows(report: dict) -> list[dict]:
    """The summaries after each job, in order; a ValueError naming what is
    missing when the report has none."""
    jobs = report.get("jobs") if isinstance(report, dict) else None
    if not isinstance(jobs, list):
        raise ValueError("not a teach report: it has no list of jobs")
    rows = [j["summary"] for j in jobs if isinstance(j, dict) and "summary" in j]
    if not rows:
        raise ValueError("its jobs have no summaries: write the report with --score-each-job")
    return rows


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("report", help="a report written by `resident-trainer teach ... --score-each-job --report`")
    p.add_argument("out", help="the PNG to write")
    p.add_argument("--title", default=None, help="the plot's title (default: the facts, jobs and neurons)")
    args = p.parse_args(argv)
    if not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):
        p.error(f"out: folder {os.path.dirname(os.path.abspath(args.out))} does not exist")
    try:
        with open(args.report, encoding="utf-8") as f:
            report = json.load(f)
        rows = job_rows(report)
    except (OSError, ValueError) as e:
        p.error(f"report {args.report}: {e}")
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p.error("the plot needs matplotlib: pip install matplotlib")
    from _plots import figure

    neurons = (report.get("config") or report.get("settings") or {}).get("num_neurons")
    title = args.title or (
        f"{rows[-1]['facts']} facts in {len(rows)} jobs"
        + (f", {neurons} neurons" if neurons else "")
        + ", after each job"
    )
    figure(
        [r["facts"] for r in rows], rows, "facts taught so far", title, args.out, "lower left", ticks=len(rows) <= 12
    )
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
