"""The benchmark suite's one entry: ``python -m bench NAME`` runs a benchmark, ``--help`` lists
every one with its summary, each has a quick mode for ``make bench-smoke``, and the decision
cost's A/B starts each checkout's own copy of the benchmark, whatever its layout. The quick runs
themselves are ``make bench-smoke``'s (seconds each, real processes)."""

from __future__ import annotations

import argparse
import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from bench.__main__ import main as entry
from bench.__main__ import parser
from bench.decision_cost import child_command
from bench.suite import (
    BENCHMARKS,
    PACKAGE,
    SMOKE_ARGS,
    SMOKE_MORE,
    add_quick,
    apply_quick,
    smoke,
    summary,
)

REPO = PACKAGE.parent

HELPERS = {"fleet_probe", "floor_proxy", "otlp_sink", "overhead_report", "traced_sidecar"}
"""Programs that are not benchmarks (``python -m bench.X``): those the benchmarks start in
subprocesses, and the renderer of the overhead report's tables."""


def _defines(path: Path, name: str) -> bool:
    tree = ast.parse(path.read_text())
    return any(isinstance(node, ast.FunctionDef) and node.name == name for node in tree.body)


def test_every_module_with_a_command_line_is_a_benchmark_or_a_helper() -> None:
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    with_main = {
        stem
        for stem in modules
        if _defines(PACKAGE / f"{stem}.py", "main_cli") or _defines(PACKAGE / f"{stem}.py", "main")
    }
    assert set(BENCHMARKS) <= modules
    # decision_kv's main is decision_cost's callgrind child; __main__ is the entry itself.
    assert with_main - set(BENCHMARKS) - HELPERS == {"decision_kv", "__main__"}
    assert list(BENCHMARKS) == sorted(BENCHMARKS)


def test_no_module_of_bench_edits_sys_path() -> None:
    edits = [
        f"{path.relative_to(REPO)}:{number}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if "sys.path" in line
    ]
    assert edits == []


def test_help_lists_every_benchmark_with_its_summary() -> None:
    text = parser().format_help()
    for name in BENCHMARKS:
        line = next(line for line in text.splitlines() if line.split()[:1] == [name])
        assert summary(name) in line
        assert summary(name).endswith(".")
        assert "\n" not in summary(name)
        assert len(summary(name)) <= 100


@pytest.mark.parametrize("name", BENCHMARKS)
def test_each_benchmark_has_its_prog_and_a_quick_mode(
    name: str, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"bench.{name}")
    with pytest.raises(SystemExit) as stop:
        module.main_cli(["--help"])
    assert stop.value.code == 0
    help_text = capsys.readouterr().out
    assert help_text.startswith(f"usage: python -m bench {name} ")
    assert "--quick" in help_text


def test_the_smoke_runs_flags_are_the_benchmarks_own() -> None:
    from bench.simulate import parse_args

    assert set(SMOKE_ARGS) == {"simulate"}
    args = parse_args(["--quick", *SMOKE_ARGS["simulate"]])
    assert (args.quick, args.scenario, args.seeds, args.requests) == (True, "standard", [1], 300)
    from bench.fleet import main_parser

    assert set(SMOKE_MORE) == {"fleet"}
    [counters] = SMOKE_MORE["fleet"]
    assert main_parser().parse_args(["--quick", *counters]).reservations == "counters"


def test_the_entry_runs_a_benchmark_by_its_module_name() -> None:
    done = subprocess.run(
        [sys.executable, "-m", "bench", "resp_bounds", "--help"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith("usage: python -m bench resp_bounds ")


def test_an_unknown_name_is_refused_with_the_list(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as stop:
        entry(["ceiling"])
    assert stop.value.code == 2
    assert "invalid choice: 'ceiling'" in capsys.readouterr().err


def test_quick_replaces_only_the_defaults_the_command_line_left() -> None:
    command = argparse.ArgumentParser()
    command.add_argument("--seconds", type=float, default=40.0)
    command.add_argument("--rate", type=float, default=10_000)
    add_quick(command, "short")
    quick = apply_quick(command, command.parse_args(["--quick"]), seconds=3.0, rate=100.0)
    assert (quick.seconds, quick.rate) == (3.0, 100.0)
    given = apply_quick(
        command, command.parse_args(["--quick", "--seconds", "9"]), seconds=3.0, rate=100.0
    )
    assert (given.seconds, given.rate) == (9.0, 100.0)
    full = apply_quick(command, command.parse_args([]), seconds=3.0, rate=100.0)
    assert (full.seconds, full.rate) == (40.0, 10_000)


def test_the_ab_child_is_each_checkouts_own_benchmark(tmp_path: Path) -> None:
    old = tmp_path / "old"  # the layout of the start commit: scripts, no entry
    (old / "bench").mkdir(parents=True)
    (old / "bench" / "decision_cost.py").write_text("")
    command, env = child_command(old)
    assert command == [sys.executable, str(old / "bench" / "decision_cost.py")]
    assert env["DECISION_COST_REPO"] == str(old)
    assert env["PYTHONHASHSEED"] == "0"
    command, env = child_command(REPO)
    assert command == [sys.executable, "-m", "bench.decision_cost"]
    assert "DECISION_COST_REPO" not in env
    assert "PYTHONPATH" not in env


@pytest.mark.system  # a benchmark's quick run in a process of its own: ~1 s
def test_the_smoke_run_runs_each_quick_mode_and_times_it(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert smoke(("resp_bounds",)) == 0
    out = capsys.readouterr().out
    assert "[smoke] resp_bounds: " in out
    assert "exit status 0" in out
