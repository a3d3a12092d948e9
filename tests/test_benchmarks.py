"""The benchmarks never rot: their smoke run (``python -m benchmarks --quick``) prints every table."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # subprocesses

ROOT = Path(__file__).resolve().parent.parent
WORKLOADS = ["mlp", "transformer", "optim", "state_dict", "register", "access", "eval"]


def _run(args: list[str], tmp_path: Path, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout
    )


def test_quick_run_prints_every_table(tmp_path: Path) -> None:
    """`python -m benchmarks --quick` exits 0 and prints each workload's tables and the targets."""
    done = _run(["-m", "benchmarks", "--quick", "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    for name in WORKLOADS:
        assert f"## {name}:" in out, name
    for title in (
        "MLP forward+backward against depth",
        "Transformer training step, AdamW fused=True",
        "Optimizer step, 20 small parameters",
        "Implementation torch picks",
        "state_dict() and load_state_dict()",
        "Flattening 4 x Linear(1024, 1024)",
        "One `layer.weight` access",
        "TransformerEncoder passes, each contender in its own process",
        "Targets of the issue",
    ):
        assert f"### {title}" in out, title
    assert "MLP depth 10: per-tensor floor (no library) / plain" in out  # the floor, measured in the same run
    assert "MLP depth 10: per-tensor mode / its floor" in out
    assert "MLP depth 10: per-tensor mode / plain, gradients accumulating" in out
    assert "ddp: skipped in --quick" in out
    assert "mixed_precision: skipped in --quick" in out
    assert "FAILED" not in out
    assert (tmp_path / "results.md").read_text().startswith("# flatten_parametrize benchmarks")


def test_time_across_processes_asks_each_contenders_processes_in_rotation_in_alternating_order() -> None:
    """Round r asks process r % n of every contender; rounds go A B, B A, ... (`benchmarks/_processes.py`)."""
    from benchmarks._processes import Worker, started, time_across_processes

    serve_pid = (
        "import os, sys, time\n"
        "sys.path.insert(0, sys.argv[1])\n"
        "from benchmarks._processes import serve\n"
        "serve(lambda what: {'pid': os.getpid(), 'what': what, 'at': time.monotonic_ns()})\n"
    )
    workers = {
        name: [
            Worker([sys.executable, "-c", serve_pid, str(ROOT)], f"{name} #{i}", os.environ) for i in range(n)
        ]
        for name, n in (("a", 3), ("b", 2))
    }
    with started([w for ws in workers.values() for w in ws], timeout=120):
        found = time_across_processes(workers, "row", 6)
    for name, processes in workers.items():
        pids = [p.proc.pid for p in processes]
        assert [m["pid"] for m in found[name]] == [pids[r % len(pids)] for r in range(6)]
        assert all(m["what"] == "row" for m in found[name])
    a_first = [a["at"] < b["at"] for a, b in zip(found["a"], found["b"])]
    assert a_first == [True, False] * 3


def test_mixed_precision_quick_run_prints_its_tables(tmp_path: Path) -> None:
    """`--only mixed_precision --quick` runs every contender in its own process(es) and prints the tables.

    Its last table is the 2-rank gloo row: FSDP2 with the policy against the flattened model's.
    """
    done = _run(
        ["-m", "benchmarks", "--quick", "--only", "mixed_precision", "--out", str(tmp_path)], tmp_path
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    out = done.stdout
    assert "### Mixed precision, encoder" in out and "### Quality: 20 AdamW steps" in out
    for contender in (
        "plain autocast",
        "flat autocast",
        "plain bfloat16",
        "hand-written mixed",
        "lean mixed (floor)",
        "flat + policy",
        "per-tensor + policy",
    ):
        assert f"| {contender} " in out, contender
    assert "4 + 2 + 4 = 10" in out and "FAILED" not in out
    assert "Rounds per row: step, 1 micro-batch 5, step, 4 micro-batches 5, forward+backward 5" in out
    kept = json.loads((tmp_path / "mixed_precision_calls.json").read_text())  # every timed call, by round
    assert sorted(kept) == [
        "encoder/forward+backward",
        "encoder/step, 1 micro-batch",
        "encoder/step, 4 micro-batches",
    ]
    for per_contender in kept.values():
        assert len(per_contender) == 8
        assert all(len(rounds) == 5 and all(calls for calls in rounds) for rounds in per_contender.values())
    assert "### Mixed precision on 2 gloo ranks" in out
    for contender in ("FSDP2 + mp_policy", "flat + policy + grad sync", "flat + policy + ZeRO-2"):
        assert f"| {contender} " in out, contender


@pytest.mark.parametrize("model", ["encoder", "gpt2"])
def test_mixed_precision_floor_does_the_hand_written_loops_arithmetic_bit_for_bit(model: str) -> None:
    """The floor contender (``lean mixed``) does all of mixed precision's work, without per-forward costs.

    A floor that skipped a cast or an accumulation would not be a floor: after two 4-micro-batch steps its
    float32 masters equal the hand-written loop's and per-tensor mode's to the last bit.
    """
    import torch

    from benchmarks import bench_mixed_precision as bench

    size = bench._size(quick=True)
    masters = {}
    for contender in (bench.HAND, bench.LEAN, bench.PT_POLICY):
        torch.manual_seed(0)
        built, batches, loss = bench._build(model, size)
        trainer = bench._Trainer(contender, built, loss)
        for _ in range(2):
            trainer.step(batches)
        masters[contender] = [p.detach().clone() for p in trainer.params]
    assert len(masters[bench.LEAN]) == len(masters[bench.HAND]) > 1
    for contender in (bench.LEAN, bench.PT_POLICY):
        for mine, theirs in zip(masters[contender], masters[bench.HAND]):
            assert mine.dtype == torch.float32
            assert torch.equal(mine, theirs), contender


@pytest.mark.parametrize("row", ["1", "fb"])
def test_mixed_precision_in_process_ab_prints_every_contender(tmp_path: Path, row: str) -> None:
    """`python -m benchmarks.ab_mixed_precision --quick` times the contenders call by call, with ratios."""
    done = _run(["-m", "benchmarks.ab_mixed_precision", "--quick", "--turns", "3", "--row", row], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    base = "plain bfloat16" if row == "fb" else "plain autocast"
    assert f"ratios to {base} (lower is faster)" in done.stdout
    for contender in (
        "plain autocast",
        "plain bfloat16",
        "hand-written mixed",
        "lean mixed (floor)",
        "flat + policy",
    ):
        assert f"| {contender} | " in done.stdout, contender


def test_per_tensor_in_process_ab_prints_every_optimizer_and_contender(tmp_path: Path) -> None:
    """`python -m benchmarks.ab_per_tensor --quick` times plain, per-tensor, flat per step and optimizer."""
    done = _run(["-m", "benchmarks.ab_per_tensor", "--quick", "--turns", "3"], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for label in ("AdamW foreach=True", "AdamW fused=True", "Adafactor"):
        assert f"{label}: 3 turns" in done.stdout, label
    for contender in ("plain", "per-tensor mode", "register_flat_storage"):
        assert done.stdout.count(f"| {contender} | ") == 3, contender


def test_per_tensor_mlp_in_process_ab_prints_every_contender_and_ratio(tmp_path: Path) -> None:
    """`python -m benchmarks.ab_per_tensor_mlp --quick` times the MLP's per-tensor contenders call by call."""
    done = _run(["-m", "benchmarks.ab_per_tensor_mlp", "--quick", "--turns", "3"], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    for contender in ("plain", "floor", "per-tensor", "plain, accumulating", "per-tensor, accumulating"):
        assert f" {contender} " in done.stdout, contender
    for ratio in ("per-tensor / floor ", "per-tensor, accumulating / plain, accumulating "):
        assert ratio in done.stdout, ratio


def test_missing_fairscale_is_reported_not_failed(tmp_path: Path) -> None:
    """Without fairscale its rows read "not installed" and the run still succeeds."""
    code = (
        "import sys; sys.modules['fairscale'] = None\n"  # makes `import fairscale` raise ImportError
        "from benchmarks.run import main\n"
        f"sys.exit(main(['--quick', '--only', 'access,state_dict', '--out', {str(tmp_path)!r}]))\n"
    )
    done = _run(["-c", code], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| fairscale FPW")]
    assert len(rows) == 2 and all("not installed" in row for row in rows), rows


def test_script_entry_point_and_unknown_workload(tmp_path: Path) -> None:
    """`python benchmarks/run.py --help` works as a script; an unknown --only name is refused."""
    done = _run(["benchmarks/run.py", "--help"], tmp_path)
    assert done.returncode == 0 and "--quick" in done.stdout
    done = _run(["-m", "benchmarks", "--only", "nonsense"], tmp_path)
    assert done.returncode != 0 and "unknown workload" in done.stderr


@pytest.mark.parametrize("rounds", [1, 4])
def test_fewer_than_five_rounds_is_refused(rounds: int) -> None:
    """A median needs at least 5 timed rounds."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks._timing import Settings
    finally:
        sys.path.remove(str(ROOT))
    with pytest.raises(ValueError, match="at least 5"):
        Settings(rounds=rounds)


def test_ddp_benchmark_quick_run_times_every_contender_in_its_own_processes(tmp_path: Path) -> None:
    """`benchmarks/bench_ddp.py --quick` starts a process pair per contender and prints the ratio table."""
    done = _run(["benchmarks/bench_ddp.py", "--quick", "--timeout", "240"], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| DDP", "| flat"))]
    assert [row.split("|")[1].split("(")[0].strip() for row in rows] == [
        "DDP",
        "DDP gradient_as_bucket_view",
        "flat, buckets",
        "flat, one group",
    ]
    assert "Target `flat, buckets` / DDP <= 1.00:" in done.stdout


def test_zero_benchmark_quick_run_times_every_contender_and_reports_targets(tmp_path: Path) -> None:
    """`benchmarks/bench_zero.py --quick` times each contender in its own processes and prints the targets.

    Its second table is ``bench_zero_whole.py``'s: Muon + AdamW sharded by whole tensors and its anchors.
    """
    done = _run(["benchmarks/bench_zero.py", "--quick", "--timeout", "240"], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line.split("|")[1].strip() for line in done.stdout.splitlines() if line.startswith("| ")]
    rows = [row for row in rows if row != "contender"]  # the two tables' headers
    assert rows == [
        "DDP + AdamW",
        "flat buckets + AdamW",
        "flat buffers by hand + AdamW (floor)",
        "flat buckets + AdamW, per-tensor mode",
        "DDP + AdamW fused",
        "flat buckets + AdamW fused",
        "ShardedOptimizer ZeRO-1",
        "ShardedOptimizer ZeRO-2",
        "ZeroRedundancyOptimizer + DDP",
        "FSDP2 fully_shard",
        "(a) DDP, replicated",
        "(b) DDP + ZeroRedundancyOptimizer",
        "(c) layer-wise by hand (floor)",
        "(d) whole tensors, ZeRO-1",
        "(e) whole tensors, ZeRO-2",
        "(f) nanochat's scheme",
        "element-wise ZeRO-2, AdamW",
    ]
    assert "Targets: ZeRO-2 step <= 1.10x DDP:" in done.stdout
    assert "Targets: (e) step <= 1.00x (f):" in done.stdout
    assert "(e) step <= 1.00x the faster of (b) and (c):" in done.stdout
    assert "Whole-tensor cut: elements per rank" in done.stdout
    assert "NCCL's one-buffer path would pad bucket by bucket" in done.stdout
    assert "per-tensor mode peak RSS <= 1.00x DDP:" in done.stdout
    assert "its floor (flat buffers by hand) peak RSS <= 1.00x DDP:" in done.stdout


def test_zero_scale_quick_run_simulates_every_model_and_world_size(tmp_path: Path) -> None:
    """`python -m benchmarks --only zero_scale --quick`: one row per model and W, each with its verdicts."""
    done = _run(["-m", "benchmarks", "--only", "zero_scale", "--quick", "--out", str(tmp_path)], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "state met" in line]
    assert len(rows) == 4 * 2, done.stdout[-4000:]
    for model in ("GPT-2 124M", "Llama-3-8B", "Qwen3-30B-A3B", "nanochat d20"):
        assert sum(model in row for row in rows) == 2, model
    assert all("bytes met" in row for row in rows)
    assert "Verdicts: " in done.stdout and "FAILED" not in done.stdout


def test_zero_scale_moves_buckets_of_one_matrix_in_units_and_shows_the_bound_where_none_can() -> None:
    """Two equal matrices on 2 ranks, each its own bucket: one unit, no padding; one matrix: its bound.

    Alone, each bucket would be one rank's (100% padding); the plan laid out for one buffer moves both
    in one unit, each rank's matrix in its slot (met). One matrix on 2 ranks pads 100% under any
    layout: its bound is shown (``None``), and an unmet row is NOT met.
    """
    sys.path.insert(0, str(ROOT))
    try:
        import torch

        from benchmarks.bench_zero_scale import simulate, verdicts
        from flatten_parametrize._distributed.sharded_strategies import buckets_of
    finally:
        sys.path.remove(str(ROOT))
    matrix = (64, (8, 8))
    two = buckets_of([(64, 4, [(0, 0, *matrix)]), (64, 4, [(1, 0, *matrix)])], [[torch.optim.Muon]] * 2)
    row = simulate(two, 2)
    assert row["padding"] == 0.0 and row["by_owner"] == 0.0 and row["unit"] == 2.0  # both ranks' shares
    assert row["layout_padding_bound"] == 1.0 and row["padding_bound"] == 0.0
    assert verdicts(row)["padding"] is True and row["collectives"] == 2
    one = simulate(two[:1], 2)
    assert one["padding_bound"] == 1.0 and verdicts(one)["padding"] is None
    assert verdicts({**row, "padding": 0.5})["padding"] is False


def test_zero_scale_shows_the_padding_bound_of_units_within_the_budget() -> None:
    """Eight buckets of one matrix on 8 ranks: one unit of all would pad nothing, but it holds 8 rank
    shares; within the budget (4) each matrix pads its unit at least 8 x 64 / 256 - 1 = 100%."""
    sys.path.insert(0, str(ROOT))
    try:
        import torch

        from benchmarks.bench_zero_scale import simulate, verdicts
        from flatten_parametrize._distributed.sharded_strategies import buckets_of
    finally:
        sys.path.remove(str(ROOT))
    eight = buckets_of([(64, 4, [(b, 0, 64, (8, 8))]) for b in range(8)], [[torch.optim.Muon]] * 8)
    row = simulate(eight, 8)
    assert row["padding_bound"] == 0.0 and row["padding_budget_bound"] == 1.0
    assert row["padding"] > 0.05 and verdicts(row)["padding"] is None
    assert simulate(eight, 4)["padding_budget_bound"] == 0.0  # 4 x 64 / 512 - 1 < 0: no bound


def test_zero_benchmark_times_the_collectives_that_move_slices(tmp_path: Path) -> None:
    """`bench_zero.py --collectives 2 --quick` prints one row per way of gathering and reducing slices."""
    done = _run(["benchmarks/bench_zero.py", "--quick", "--collectives", "2"], tmp_path)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    rows = [line for line in done.stdout.splitlines() if line.startswith(("| gather", "| reduce"))]
    assert len(rows) == 6 and sum("used on gloo" in row for row in rows) == 2


def test_ddp_benchmark_reports_a_rank_that_ends_instead_of_waiting(tmp_path: Path) -> None:
    """A rank that exits before answering raises with its exit code and last output."""
    sys.path.insert(0, str(ROOT))
    try:
        from benchmarks.bench_ddp import _rank
    finally:
        sys.path.remove(str(ROOT))
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    rank = _rank(["--quick"], 0, 1, "no such contender", env)
    expected = r"(?s)'no such contender' rank 0 ended \(exit code 1\).*unknown contender"
    with pytest.raises(RuntimeError, match=expected):
        rank.receive()
    with pytest.raises(RuntimeError, match=expected):
        rank.send("go")  # writing to a rank that is gone reports its output too


def _benchmark_imports() -> dict[str, set[str]]:
    """Return each module of ``benchmarks/`` and the modules of ``benchmarks/`` it imports."""
    modules = {path.stem: path for path in (ROOT / "benchmarks").glob("*.py")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        found: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == "benchmarks":
                found |= {alias.name for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("benchmarks."):
                found.add(str(node.module).split(".")[-1])
            elif isinstance(node, ast.Import):
                found |= {a.name.split(".")[-1] for a in node.names if a.name.startswith("benchmarks.")}
        edges[name] = found & set(modules)
    return edges


def test_the_benchmarks_import_no_circle():
    """A module of ``benchmarks/`` never imports one that imports it back (directly or not)."""
    edges = _benchmark_imports()
    circles = []
    for start in edges:
        stack = [(start, [start])]
        while stack:
            name, path = stack.pop()
            for nxt in edges[name]:
                if nxt == start:
                    circles.append(" -> ".join([*path, nxt]))
                elif nxt not in path:
                    stack.append((nxt, [*path, nxt]))
    assert circles == [], circles
