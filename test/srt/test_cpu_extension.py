"""Building the C++ CPU kernels (layers/cpu_extension.py): a build stopped midway must not
stop later starts."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from server_test_utils import REPO_ROOT

from sglang.srt.layers.cpu_extension import (
    _exclusive_build,
    load_side_by_side,
    platform_supported,
)

pytestmark = pytest.mark.skipif(
    not platform_supported(),
    reason="the kernels are built on Linux (x86-64 or aarch64) only",
)

# Loads the fused elementwise kernels in a fresh process (built on first use, then cached) and
# prints the folder they were built in.
_LOAD_SCRIPT = """
import os
from sglang.srt.layers import cpu_fused_ops
assert cpu_fused_ops.load_kernel()
print(os.path.dirname(cpu_fused_ops._KERNEL.loaded.__file__))
"""


def _env() -> dict[str, str]:
    paths = [str(REPO_ROOT / "python"), str(REPO_ROOT / "sgl-kernel" / "python")]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + [os.environ.get("PYTHONPATH", "")])}


def _load_in_subprocess(timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _LOAD_SCRIPT], capture_output=True, text=True,
                          env=_env(), timeout=timeout, check=True)


def test_a_lock_left_by_a_killed_build_is_removed_and_the_kernel_loads() -> None:
    build_dir = Path(_load_in_subprocess(timeout=600).stdout.strip().splitlines()[-1])
    # What a build killed midway leaves: torch's lock file, which only the builder removes.
    # Without the fix the next load waits on it forever (the timeout fails the test).
    (build_dir / "lock").touch()
    result = _load_in_subprocess(timeout=300)
    assert Path(result.stdout.strip().splitlines()[-1]) == build_dir
    assert not (build_dir / "lock").exists()
    assert "left by a build that was stopped" in result.stderr


def test_the_build_lock_is_exclusive_and_ends_with_its_holder(tmp_path: Path) -> None:
    # A process that holds the lock and is then killed: its flock ends with it.
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys, time\n"
         "from sglang.srt.layers.cpu_extension import _exclusive_build\n"
         f"with _exclusive_build({str(tmp_path)!r}, 'test kernel'):\n"
         "    print('held', flush=True)\n"
         "    time.sleep(300)\n"],
        stdout=subprocess.PIPE, text=True, env=_env(),
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with open(tmp_path / "sglang_build.flock", "a") as probe, pytest.raises(BlockingIOError):
            fcntl.flock(probe, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        holder.kill()
        holder.wait(30)
    (tmp_path / "lock").touch()
    with _exclusive_build(str(tmp_path), "test kernel"):
        assert not (tmp_path / "lock").exists()


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core builds one kernel at a time")
def test_kernels_load_side_by_side_and_a_failure_is_raised() -> None:
    # Both loaders must be running at once to pass the barrier (a sequential run times out).
    barrier = threading.Barrier(2, timeout=30)
    done: list[str] = []

    def loader(name: str) -> bool:
        barrier.wait()
        done.append(name)
        return True

    load_side_by_side([lambda: loader("a"), lambda: loader("b")])
    assert sorted(done) == ["a", "b"]

    def broken() -> bool:
        raise RuntimeError("compiler exploded")

    with pytest.raises(RuntimeError, match="compiler exploded"):
        load_side_by_side([broken, lambda: True])
    load_side_by_side([])
