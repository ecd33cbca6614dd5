"""bench/plot_jobs.py's reading of a teach report and its argument errors
(the drawing itself needs matplotlib, which the tests do not install)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _plot_jobs():
    spec = importlib.util.spec_from_file_location("plot_jobs", ROOT / "bench" / "plot_jobs.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _summary(facts, recalled):
    return {"facts": facts, "recalled": recalled, "rewordings": facts, "rewordings_recalled": recalled - 1}


def test_job_rows_are_each_jobs_summary_in_order():
    pj = _plot_jobs()
    report = {"jobs": [{"summary": _summary(16, 16)}, {"steps": 75}, {"summary": _summary(32, 30)}]}
    assert [r["recalled"] for r in pj.job_rows(report)] == [16, 30]
    with pytest.raises(ValueError, match="--score-each-job"):
        pj.job_rows({"jobs": [{"steps": 75}]})
    for bad in ({}, [], {"jobs": "x"}):
        with pytest.raises(ValueError, match="not a teach report"):
            pj.job_rows(bad)


def test_argument_errors_name_the_report_or_the_folder(tmp_path, capsys):
    pj = _plot_jobs()
    missing = tmp_path / "none.json"
    with pytest.raises(SystemExit) as e:
        pj.main([str(missing), str(tmp_path / "p.png")])
    assert e.value.code == 2 and f"report {missing}" in capsys.readouterr().err
    unscored = tmp_path / "r.json"
    unscored.write_text(json.dumps({"jobs": [{"steps": 75}]}))
    with pytest.raises(SystemExit):
        pj.main([str(unscored), str(tmp_path / "p.png")])
    assert "--score-each-job" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        pj.main([str(unscored), str(tmp_path / "no" / "p.png")])
    assert "does not exist" in capsys.readouterr().err
