"""Every flag of the benchmark scripts explains itself in ``--help`` (read from their source, so
no script is imported or run)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

BENCHMARK_DIR = Path(__file__).resolve().parents[2] / "benchmark"
SCRIPTS = sorted(BENCHMARK_DIR.glob("*.py"))


def _flags_without_help(path: Path) -> list[str]:
    """The first option string of each ``add_argument(...)`` call in ``path`` that has no
    non-empty ``help=``."""
    missing = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if not (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr == "add_argument"
        ):
            continue
        help_kw = next((kw.value for kw in node.keywords if kw.arg == "help"), None)
        empty = isinstance(help_kw, ast.Constant) and not help_kw.value
        if help_kw is None or empty:
            names = [a.value for a in node.args if isinstance(a, ast.Constant)]
            missing.append(str(names[0]) if names else f"line {node.lineno}")
    return missing


def test_the_benchmark_folder_has_scripts() -> None:
    assert len(SCRIPTS) >= 10, BENCHMARK_DIR


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: p.name)
def test_every_benchmark_flag_has_help(path: Path) -> None:
    assert _flags_without_help(path) == []


def test_the_check_finds_a_flag_without_help(tmp_path: Path) -> None:
    script = tmp_path / "bench_x.py"
    script.write_text(
        "import argparse\n"
        "p = argparse.ArgumentParser()\n"
        "p.add_argument('--ok', help='does a thing')\n"
        "p.add_argument('--bare', type=int)\n"
        "p.add_argument('--blank', help='')\n"
    )
    assert _flags_without_help(script) == ["--bare", "--blank"]
