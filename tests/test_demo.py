"""The demo of ``python -m flatten_parametrize demo`` runs and shows flat and plain training agreeing."""

from __future__ import annotations

import configparser
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest

from flatten_parametrize.__main__ import main as cli_main
from flatten_parametrize._demo import main as demo_main


@pytest.mark.slow
def test_demo_command_runs_and_agrees() -> None:
    """`python -m flatten_parametrize demo --steps 5` exits 0 and prints summary, both losses and OK."""
    proc = subprocess.run(
        [sys.executable, "-m", "flatten_parametrize", "demo", "--steps", "5"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FlatStorage of TinyLM" in out
    assert "encoder.layers.0.self_attn.in_proj_weight" in out
    assert "loss (flat)" in out and "loss (plain)" in out
    assert "median time per step" in out and "ratio flat/plain" in out
    assert "OK:" in out and "MISMATCH" not in out
    assert proc.stderr == "", proc.stderr  # no warnings on public-facing output


def test_demo_main_in_process() -> None:
    """The demo's main function returns 0 and prints one loss row per reported step."""
    out = io.StringIO()
    assert demo_main(2, threads=None, out=out) == 0
    text = out.getvalue()
    assert "loss (flat)" in text and "loss (plain)" in text
    rows = [line.split() for line in text.splitlines() if line.strip().split(" ")[0] in {"1", "2"}]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[1]) == float(row[2]) for row in rows)


def test_cli_refuses_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """`--steps 0` is refused by argparse with exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["demo", "--steps", "0"])
    assert exit_.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_readme_demo_command_installs_numpy_so_torch_prints_no_warning() -> None:
    """The README's demo command installs an extra with NumPy (torch warns on import without it)."""
    root = Path(__file__).resolve().parents[1]
    readme = (root / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "python -m flatten_parametrize demo" in line)
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', command)
    assert extras is not None, command
    config = configparser.ConfigParser()
    config.read(root / "setup.cfg")
    provided = {
        requirement.strip().lower()
        for extra in extras.group(1).split(",")
        for requirement in config["options.extras_require"][extra].splitlines()
    }
    assert "numpy" in provided
