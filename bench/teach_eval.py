"""The teaching evaluation on the development set's report half (settings were
chosen on the tune half): SmolLM2-135M-Instruct in this process.

    python bench/teach_eval.py [--half report] [--out docs/teaching.json] [--plots docs]

Runs, one after the other, with the shipped TrainConfig and near negatives:
1. one job of the half's 24 facts (two rounds of 12, 120 steps: the steps a
   job takes when none are given, `train.steps_for`), scored at 40, 80 and 120
   steps, with the baselines (gate off; the gate without its arming; the fact
   given in the prompt);
2. the same 24 facts in 4 jobs of 6 on one block, scored after each job;
3. a retraction job removing 2 of them;
4. capacity: the 128 facts of the capacity set (no setting was chosen on
   them) in one job, on a block of 1152 neurons (8 rounds of 16, 75 steps
   each: 600);
5. the same 128 in 8 jobs of 16 (75 steps each) on one block, scored after each job, with
   the baselines;
6. the fresh facts (24 of 12 kinds the development set lacks, written after
   every setting was fixed) in one job, with the baselines, and in 3 jobs of
   8, scored after each job, with the 14 generic controls and their own 14
   near controls (eval/data/fresh_near_controls.txt).
With --half tune the tune half's facts and near controls
(eval/data/near_controls_tune.txt), the capacity tune set and the fresh tune
facts take their places.
Writes the reports as one JSON file and three plots (matplotlib PNG): recall,
rewordings and controls against steps, against jobs (facts taught so far),
and against the number of facts held. Prints the CPU's model name; 45-60
minutes on 2 cores (`--only` runs the parts it names). Needs matplotlib
(`pip install matplotlib`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


PARTS = ("one_job", "four_jobs", "capacity_one_job", "capacity_eight_jobs", "fresh_one_job", "fresh_three_jobs")


def cpu_model() -> str:
    """lscpu's model name, with the family/model numbers and the widest
    vector extension (the name alone is "AMD EPYC" on some machines)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return "unknown CPU"
    info = {k.strip(): v.strip() for k, _, v in (line.partition(":") for line in out.splitlines())}
    flags = info.get("Flags", "").split()
    vec = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2"
    return f"{info.get('Model name', 'unknown CPU')} (family {info.get('CPU family', '?')} model {info.get('Model', '?')}, {vec})"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--half", choices=["tune", "report"], default="report", help="development set half (default: report)"
    )
    p.add_argument("--out", default="docs/teaching.json", help="where the reports go (default: docs/teaching.json)")
    p.add_argument("--plots", default="docs", help="folder for the PNG plots (default: docs)")
    p.add_argument("--negatives", type=int, default=4, help="near negatives per fact (default: 4)")
    p.add_argument(
        "--suffix-dtype",
        choices=["weights", "auto", "bfloat16"],  # train.config.SUFFIX_DTYPE_FLAGS (torch is imported later)
        default="weights",
        help="TrainConfig.suffix_dtype: what the layers after the block compute in while training (default: "
        "weights, float32)",
    )
    p.add_argument(
        "--only",
        choices=PARTS,
        nargs="+",
        default=None,
        help="run only these parts, keeping the others from the existing --out file",
    )
    args = p.parse_args(argv)
    try:
        import matplotlib  # noqa: F401  (checked first: the plots come after 15 minutes of work)
    except ImportError:
        p.error("the plots need matplotlib: pip install matplotlib")
    for folder in (os.path.dirname(os.path.abspath(args.out)), args.plots):
        if not os.path.isdir(folder):
            p.error(f"folder {folder} does not exist")
    if args.only is not None and not os.path.exists(args.out):
        p.error(f"--only keeps the other parts from --out {args.out}, which does not exist")

    import torch

    from resident_trainer.eval.devset import capacity_facts, dev_facts, fresh_facts
    from resident_trainer.eval.report import summary_line
    from resident_trainer.eval.teach import default_controls, split_jobs, teach_jobs
    from resident_trainer.models import load_smollm2
    from resident_trainer.train import TrainConfig, steps_for
    from resident_trainer.train.config import SUFFIX_DTYPE_FLAGS, fact_neurons

    cpu = cpu_model()
    print(f"CPU: {cpu}; {torch.get_num_threads()} threads", flush=True)
    facts = dev_facts(args.half)
    config = TrainConfig(suffix_dtype=SUFFIX_DTYPE_FLAGS[args.suffix_dtype])
    out = {"cpu": cpu, "half": args.half, "negatives": args.negatives, "config": vars(config) | {}}
    tune = args.half == "tune"
    many = capacity_facts(tune=tune)  # the capacity tune set with the tune half
    controls = default_controls(tune=tune)  # the tune half's near controls with it
    fresh = fresh_facts(tune=tune)  # the fresh tune facts with the tune half
    fresh_controls = default_controls(tune=tune, fresh=True)
    # 9 neurons a fact (8 trained, a gate neuron): 1152 hold 128 facts (the default 288 hold 32).
    wide = dataclasses.replace(config, num_neurons=len(many) * fact_neurons(config))
    runs = [
        (
            "one_job",
            dict(
                jobs=split_jobs(facts, 1),
                baselines=True,
                curve_steps=(40, 80),
                config=dataclasses.replace(config, steps=steps_for(len(facts))),
            ),
        ),
        (
            "four_jobs",
            dict(jobs=split_jobs(facts, 4), score_each_job=True, retract=[facts[0].question, facts[9].question]),
        ),
        (
            "capacity_one_job",
            dict(jobs=split_jobs(many, 1), config=dataclasses.replace(wide, steps=steps_for(len(many)))),
        ),
        (
            "capacity_eight_jobs",
            dict(
                jobs=split_jobs(many, 8),
                score_each_job=True,
                baselines=True,
                config=dataclasses.replace(wide, steps=steps_for(len(many) // 8)),
            ),
        ),
        ("fresh_one_job", dict(jobs=split_jobs(fresh, 1), baselines=True, controls=fresh_controls)),
        ("fresh_three_jobs", dict(jobs=split_jobs(fresh, 3), score_each_job=True, controls=fresh_controls)),
    ]
    if os.path.exists(args.out):  # parts not rerun keep their figures (--only checked it exists)
        with open(args.out, encoding="utf-8") as f:
            kept = json.load(f)
        for k in PARTS:  # a part without its own cpu was measured on the file's
            if k in kept and "cpu" not in kept[k]:
                kept[k]["cpu"] = kept.get("cpu", "unknown CPU")
        out = {**kept, **out}
    if args.only is not None:
        runs = [r for r in runs if r[0] in args.only]
    for name, kw in runs:
        model, tok = load_smollm2()  # a fresh model each run: nothing carries over
        t0 = time.perf_counter()
        kw = {"config": config, "controls": controls, **kw}
        report = teach_jobs(model, tok, negatives=args.negatives, log=print, **kw)
        report["config"] = vars(kw["config"]) | {}
        report["cpu"] = cpu  # parts kept from an earlier file may come from another machine
        report["wall_seconds"] = round(time.perf_counter() - t0, 1)
        out[name] = report
        print(f"{name}: {summary_line(report['summary'])}; training {report['train_seconds']:.0f} s", flush=True)
        for b, s in report.get("baselines", {}).items():
            print(f"  baseline {b}: {summary_line(s)}", flush=True)
        for j in report["jobs"]:
            if "summary" in j:
                print(f"  after job: {summary_line(j['summary'])} ({j['seconds']:.0f} s)", flush=True)
        # Written after every part: a run stopped later keeps the parts it finished.
        tmp = f"{args.out}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(out, f, indent=2, default=str)
        os.replace(tmp, args.out)
    plot(out, args.plots)
    print(f"wrote {args.out} and the plots in {args.plots}")
    return 0


def plot(out: dict, folder: str) -> None:
    from _plots import figure

    cpus = {out[k].get("cpu", out["cpu"]) for k in PARTS if k in out}
    where = cpus.pop() if len(cpus) == 1 else "parts measured on different CPUs (each part's cpu in the JSON)"

    def draw(xs, summaries, xlabel, title, name, loc, **kw):
        # two lines: the CPU name is long
        figure(xs, summaries, xlabel, f"SmolLM2-135M, {title}\n{where}", os.path.join(folder, name), loc, **kw)

    one = out["one_job"]
    points = [(c["steps"], c) for c in one["jobs"][0].get("curve", [])]
    points.append((one["jobs"][0]["steps"], one["summary"]))
    draw([x for x, _ in points], [c for _, c in points], "training steps (one job of 24 facts: 12 in steps 0-60, 12 in 60-120)",
         f"{out['half']} half", "teaching_steps.png", "lower right", ticks=False)  # fmt: skip

    rows = [j["summary"] for j in out["four_jobs"]["jobs"] if "summary" in j]
    draw([r["facts"] for r in rows], rows, "facts taught so far (jobs of 6 on one block)",
         f"{out['half']} half, after each job", "teaching_jobs.png", "lower left")  # fmt: skip

    if "capacity_eight_jobs" not in out:
        return
    rows = [j["summary"] for j in out["capacity_eight_jobs"]["jobs"] if "summary" in j]
    single = out.get("capacity_one_job")
    also = None if single is None else (single["summary"]["facts"], single["summary"])
    xlabel = "facts held (capacity set, jobs of 16" + ("; squares: all 128 in one job, rounds of 16)" if also else ")")
    draw([r["facts"] for r in rows], rows, xlabel,
         f"{out['capacity_eight_jobs']['config']['num_neurons']} neurons, after each job", "teaching_facts.png",
         "lower left", also=also)  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
