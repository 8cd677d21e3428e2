"""The CPU model process's malloc settings (utils/cpu_malloc.py): freed large blocks are reused
without page faults; the free memory goes back to the kernel on request and when the weights
are released; the server applies the settings unless --disable-cpu-malloc-tuning. The allocator
checks run in a subprocess, as the settings are process-wide."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from server_test_utils import ServerProcess

from sglang.srt.utils.cpu_malloc import _glibc

pytestmark = pytest.mark.skipif(
    platform.system() != "Linux" or _glibc() is None, reason="glibc's malloc only"
)

_PROBE = r"""
import json, resource
import torch
from sglang.srt.utils.cpu_malloc import (
    FreedMemoryCap, freed_bytes, keep_freed_memory, return_freed_memory)

MB = 1 << 20

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def resident_mb():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / MB

def block(mb):
    x = torch.empty(mb * MB // 4, dtype=torch.float32)
    x.fill_(1.0)  # written in full, as a step's temporaries are
    return x

def faults_of(mb):
    before = faults()
    x = block(mb)
    del x
    return faults() - before

out = {"default": [faults_of(96), faults_of(96)]}
out["took"] = keep_freed_memory()
out["first"] = faults_of(96)  # grows the heap
out["reused"] = faults_of(64)  # fits in the freed 96 MB
return_freed_memory()  # so that the next block is all fresh pages
base = resident_mb()
x = block(256)
del x
out["kept_mb"] = resident_mb() - base
return_freed_memory()
out["returned_mb"] = resident_mb() - base

base = resident_mb()
blocks = [block(96) for _ in range(3)]
del blocks
out["freed_mb"] = freed_bytes() / MB
cap = FreedMemoryCap(limit=100 * MB, every=2)
cap.step()
out["cap_first_mb"] = resident_mb() - base  # not looked at yet
cap.step()
out["cap_second_mb"] = resident_mb() - base
print(json.dumps(out))
"""


def _probe() -> dict:
    done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_freed_blocks_are_reused_and_the_kept_memory_is_bounded() -> None:
    out = _probe()
    pages = (1 << 20) // 4096
    # glibc's default: every round maps the block afresh and faults in each of its pages.
    assert all(f > 0.9 * 96 * pages for f in out["default"]), out
    assert out["took"]
    # Kept: the first block grows the heap (faults), the next one reuses it (almost none).
    assert out["first"] > 0.9 * 96 * pages, out
    assert out["reused"] < 0.02 * 64 * pages, out
    # A freed 256 MB block stays resident until return_freed_memory hands it back.
    assert out["kept_mb"] > 200 and out["returned_mb"] < 50, out
    # Past its limit the cap hands the free memory back, on the calls it looks at.
    assert out["freed_mb"] > 250, out
    assert out["cap_first_mb"] > 250 and out["cap_second_mb"] < 50, out


@pytest.mark.parametrize("disable", [False, True])
def test_server_applies_the_settings_unless_disabled(
    tiny_model_dir: Callable[..., Path], disable: bool
) -> None:
    args = ["--skip-server-warmup"] + (["--disable-cpu-malloc-tuning"] if disable else [])
    with ServerProcess(tiny_model_dir("llama"), *args) as srv:
        log = srv.log_path.read_text(errors="replace")
    assert ("CPU malloc: freed memory kept for reuse" in log) is not disable, log


def _resident_mb(pid: int) -> float:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / (1 << 20)


def test_releasing_the_weights_gives_their_memory_back(smollm2_dir: Path) -> None:
    import sglang as sgl

    with sgl.Engine(model_path=str(smollm2_dir), dtype="float32") as eng:
        (scheduler,) = [p for p in eng._procs if p.name.startswith("sglang-scheduler")]
        # Touched at start-up (model_executor/warmup.py): the heap of a full prefill chunk
        # (~0.5 GiB) and the first 32,768 KV slots (1,440 MiB) beside the weights and their
        # packed copies (1,026 MiB); ~1.5 GiB without the warm-up.
        assert _resident_mb(scheduler.pid) > 2800
        eng.generate(input_ids=[1, 2, 3], sampling_params={"max_new_tokens": 4})
        before = _resident_mb(scheduler.pid)
        eng.release_memory_occupation(tags=["weights"])
        released = before - _resident_mb(scheduler.pid)
    # float32 SmolLM2: 513 MiB of weights and as much again of packed copies.
    assert released > 800, (before, released)
