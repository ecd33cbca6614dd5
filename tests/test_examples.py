"""The examples run and report success."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(*args, timeout=600):
    return subprocess.run([sys.executable, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT)


def test_toy_train():
    out = run("examples/toy_train.py")
    assert out.returncode == 0, out.stderr[-2000:]
    assert "A: Quen." in out.stdout and "A: Elsa." in out.stdout
    assert "byte-identical replies: 1/1" in out.stdout


def test_two_rank_training_sim_on_a_moe_model():
    # Two gloo ranks split the vocabulary head and the neurons of a Qwen2-MoE
    # toy; same losses on both ranks and as one process, base unchanged.
    out = run("examples/two_rank_training_sim.py", "--arch", "qwen2_moe", "--steps", "15")
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    for line in (
        "both ranks see the same loss at every step: True",
        "losses match the single-process run: True",
        "frozen base fingerprint unchanged on both ranks: True",
        "both ranks serve the same answer: True",
    ):
        assert line in out.stdout
