"""The demo of ``python -m flatten_parametrize demo``: flat and plain training agree, the gain is measured.

The gain is the median over alternating rounds of plain time / flat time; the demo
runs on one thread by default (no oversubscription of a 2-core machine) and says when
the machine was busy.
"""

from __future__ import annotations

import configparser
import io
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flatten_parametrize import _demo
from flatten_parametrize.__main__ import build_parser
from flatten_parametrize.__main__ import main as cli_main
from flatten_parametrize._demo import DemoResult
from flatten_parametrize._demo import main as demo_main

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_demo_command_runs_agrees_and_prints_a_gain_above_one() -> None:
    """`python -m flatten_parametrize demo` (the README's command) exits 0, agrees, measures flat faster."""
    proc = subprocess.run(
        [sys.executable, "-m", "flatten_parametrize", "demo"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout
    assert "FlatStorage of TinyLM" in out
    assert "encoder.layers.0.self_attn.in_proj_weight" in out
    assert "1 thread of" in out
    assert "loss (flat)" in out and "loss (plain)" in out
    assert "median time per step: flat" in out
    assert "OK:" in out and "MISMATCH" not in out
    gain = re.search(r"^gain: flat trains ([0-9.]+)x as fast as plain \(median of the rounds'", out, re.M)
    assert gain is not None, out
    assert float(gain.group(1)) > 1.0, out  # 75 tensors per step against 1: the flat model is faster
    assert proc.stderr == "", proc.stderr  # no warnings on public-facing output


@pytest.mark.slow
def test_bare_command_prints_the_help_and_exits_0() -> None:
    """`python -m flatten_parametrize` without a command prints the usage with the demo and exits with 0."""
    proc = subprocess.run(
        [sys.executable, "-m", "flatten_parametrize"], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("usage: python -m flatten_parametrize")
    assert "demo" in proc.stdout and proc.stderr == ""


def test_demo_main_in_process() -> None:
    """The demo's main function returns 0 and prints one loss row per reported step, equal for both models."""
    out = io.StringIO()
    assert demo_main(2, threads=None, out=out) == 0
    text = out.getvalue()
    assert "loss (flat)" in text and "loss (plain)" in text
    rows = [line.split() for line in text.splitlines() if line.strip().split(" ")[0] in {"1", "2"}]
    assert [row[0] for row in rows] == ["1", "2"]
    assert all(float(row[1]) == float(row[2]) for row in rows)


def test_rounds_alternate_which_model_goes_first(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each round trains both models on the same batches, the first one alternating; round 1 is not timed."""
    order: list[tuple[bool, int]] = []
    train_step = _demo._train_step

    def record(model: torch.nn.Module, optimizer: torch.optim.Optimizer, batch: object) -> float:
        flat = any(name.startswith("flat_param_") for name, _ in model.named_parameters())
        order.append((flat, id(batch)))
        return train_step(model, optimizer, batch)  # type: ignore[arg-type]

    monkeypatch.setattr(_demo, "_train_step", record)
    steps = 3 * _demo.ROUND_STEPS
    result = _demo.run_demo(steps, threads=None, out=io.StringIO())
    size = _demo.ROUND_STEPS
    firsts = [order[2 * size * r][0] for r in range(3)]
    assert firsts == [True, False, True]
    for r in range(3):
        round_ = order[2 * size * r : 2 * size * (r + 1)]
        assert [b for _, b in round_[:size]] == [b for _, b in round_[size:]]  # the same batches
    assert len(result.flat_times) == len(result.plain_times) == 2  # the first round warms up


def test_gain_is_the_median_of_the_paired_round_ratios() -> None:
    """The gain is the median over rounds of plain time / flat time, not a ratio of unpaired medians."""
    result = DemoResult(flat_times=[1.0, 1.0, 4.0], plain_times=[2.0, 3.0, 4.0])
    assert result.ratios == [2.0, 3.0, 1.0]
    assert result.gain == 2.0


@pytest.mark.parametrize(
    ("fields", "busy"),
    [
        ({"cpu_share": 0.99, "load_average": 0.8, "cpus": 2, "threads": 1}, False),
        ({"cpu_share": 0.6, "load_average": 0.8, "cpus": 2, "threads": 1}, True),
        ({"cpu_share": 0.99, "load_average": 3.5, "cpus": 2, "threads": 1}, True),
        ({"cpu_share": 0.99, "load_average": None, "cpus": 2, "threads": 4}, True),
    ],
)
def test_busy_machine_is_noted(fields: dict[str, object], busy: bool) -> None:
    """A low CPU share, a load above the free CPUs or more threads than CPUs make a note; idle, none."""
    result = DemoResult(flat_times=[1.0], plain_times=[1.5], **fields)  # type: ignore[arg-type]
    assert result.busy is busy
    note = _demo._busy_note(result)
    assert note.startswith("note: the machine is busy") and f"{result.cpus} CPUs" in note


def test_default_threads_do_not_oversubscribe() -> None:
    """The command and run_demo default to one thread, and run_demo restores torch's setting."""
    assert build_parser().parse_args(["demo"]).threads == 1 == _demo.THREADS
    before = torch.get_num_threads()
    _demo.run_demo(1, out=io.StringIO())
    assert torch.get_num_threads() == before


def test_cli_refuses_bad_steps(capsys: pytest.CaptureFixture[str]) -> None:
    """`--steps 0` is refused by argparse with exit status 2."""
    with pytest.raises(SystemExit) as exit_:
        cli_main(["demo", "--steps", "0"])
    assert exit_.value.code == 2
    assert "--steps" in capsys.readouterr().err


def test_readme_demo_command_installs_numpy_so_torch_prints_no_warning() -> None:
    """The README's demo command installs an extra with NumPy (torch warns on import without it)."""
    readme = (ROOT / "README.md").read_text()
    command = next(line for line in readme.splitlines() if "python -m flatten_parametrize demo" in line)
    extras = re.search(r'-e "\.\[([a-z,]+)\]"', command)
    assert extras is not None, command
    config = configparser.ConfigParser()
    config.read(ROOT / "setup.cfg")
    provided = {
        requirement.strip().lower()
        for extra in extras.group(1).split(",")
        for requirement in config["options.extras_require"][extra].splitlines()
    }
    assert "numpy" in provided
