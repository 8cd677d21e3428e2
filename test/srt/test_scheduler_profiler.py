"""The scheduler's torch profiler (upstream's /start_profile, /stop_profile): its states, its
step clock, the trace it writes and its refusals, without a model (torch ops stand in for the
forward passes)."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import pytest
import torch

from sglang.srt.managers.control_validation import check_control_request
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.io_struct import ProfileReq
from sglang.srt.managers.scheduler_profiler import SchedulerProfiler


def _forward(profiler: SchedulerProfiler) -> None:
    torch.randn(32, 32) @ torch.randn(32, 32)
    profiler.step()


def _trace(path: Path) -> dict:
    with gzip.open(path, "rt") as f:
        return json.load(f)


def test_start_stop_writes_a_chrome_trace(tmp_path: Path) -> None:
    profiler = SchedulerProfiler()
    out = profiler.handle(ProfileReq("start", str(tmp_path), profile_prefix="run-",
                                     profile_id="7"))
    assert out.success and profiler.active
    for _ in range(3):
        _forward(profiler)
    out = profiler.handle(ProfileReq("stop"))
    assert out.success and "3 step(s)" in out.message and not profiler.active
    (path,) = tmp_path.glob("run-7-pid*.trace.json.gz")
    assert str(path) in out.message
    names = {event.get("name") for event in _trace(path)["traceEvents"]}
    assert "aten::mm" in names


def test_num_steps_stops_by_itself_and_start_step_waits(tmp_path: Path) -> None:
    profiler = SchedulerProfiler()
    assert profiler.handle(ProfileReq("start", str(tmp_path), num_steps=2)).success
    _forward(profiler)
    assert profiler.active and not list(tmp_path.iterdir())
    _forward(profiler)
    assert not profiler.active and len(list(tmp_path.iterdir())) == 1
    assert not profiler.handle(ProfileReq("stop")).success  # nothing runs any more
    later = tmp_path / "later"
    out = profiler.handle(ProfileReq("start", str(later), start_step=profiler.forward_ct + 2,
                                     num_steps=1))
    assert out.success and "will start at forward step" in out.message
    _forward(profiler)  # not yet
    _forward(profiler)  # the start step: recording begins
    assert profiler.active and not list(later.iterdir())
    _forward(profiler)
    assert not profiler.active and len(list(later.iterdir())) == 1


def test_refusals_change_nothing(tmp_path: Path) -> None:
    profiler = SchedulerProfiler()
    out = profiler.handle(ProfileReq("stop"))
    assert not out.success and "not in progress" in out.message
    if not torch.cuda.is_available():
        out = profiler.handle(ProfileReq("start", str(tmp_path), activities=["GPU"]))
        assert not out.success and "CUDA" in out.message and not profiler.active
    assert profiler.handle(ProfileReq("start", str(tmp_path))).success
    out = profiler.handle(ProfileReq("start", str(tmp_path)))
    assert not out.success and "already in progress" in out.message
    waiting = SchedulerProfiler()
    assert waiting.handle(ProfileReq("start", str(tmp_path), start_step=10)).success
    assert "nothing was recorded" in waiting.handle(ProfileReq("stop")).message
    assert profiler.handle(ProfileReq("stop")).success


@pytest.mark.parametrize(("field", "value"), [
    ("action", "pause"), ("num_steps", 0), ("start_step", -1), ("activities", ["MEM"]),
    ("with_stack", "yes"), ("profile_prefix", "../x"), ("output_dir", ""),
])
def test_bad_requests_are_refused_at_the_edge(field: str, value: object) -> None:
    req = ProfileReq("start")
    setattr(req, field, value)
    with pytest.raises(InvalidRequestError, match=field):
        check_control_request(req)
