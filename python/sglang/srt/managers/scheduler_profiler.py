"""The torch profiler of one scheduler rank, driven by ``ProfileReq`` (upstream's
``/start_profile`` and ``/stop_profile``).

The Scheduler calls :meth:`SchedulerProfiler.step` once per forward pass it launches; that is the
clock of ``start_step`` (a profile waits for that step) and ``num_steps`` (a profile stops by
itself after that many steps). A stopped profile is written as a gzipped Chrome trace, which
``chrome://tracing`` and Perfetto open.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch.profiler import ProfilerActivity, profile

from sglang.srt import environ
from sglang.srt.managers.io_struct import ProfileReq, ProfileReqOutput

logger = logging.getLogger(__name__)

# Where traces go without an ``output_dir`` nor $SGLANG_TORCH_PROFILER_DIR (upstream's default).
DEFAULT_PROFILER_DIR = "/tmp"
_ACTIVITIES = {"CPU": ProfilerActivity.CPU, "GPU": ProfilerActivity.CUDA}


class SchedulerProfiler:
    """Owns this rank's profiler state: idle, waiting for ``start_step``, or recording."""

    def __init__(self) -> None:
        self.forward_ct = 0  # forward passes launched since start-up
        self._req: ProfileReq | None = None  # the profile asked for (waiting or recording)
        self._profile: profile | None = None  # the recording one
        self._steps = 0  # steps recorded so far

    @property
    def active(self) -> bool:
        """A profile was started and has not stopped (it may still wait for ``start_step``)."""
        return self._req is not None

    def handle(self, req: ProfileReq) -> ProfileReqOutput:
        """Start or stop; a refusal (bad argument, a second start, a stop with none running)
        is a reply with ``success=False`` and the reason, and changes nothing."""
        if req.action == "stop":
            if self._req is None:
                return self._reply(req, False, "Profiling is not in progress: call "
                                               "/start_profile first")
            return self._reply(req, True, self._stop())
        if req.action != "start":
            return self._reply(req, False, f"unknown profile action {req.action!r}")
        if self._req is not None:
            return self._reply(req, False, "Profiling is already in progress: call "
                                           "/stop_profile first")
        try:
            activities = _activities(req.activities)
            _check_steps(req)
            os.makedirs(_output_dir(req), exist_ok=True)
        except (ValueError, OSError) as e:
            return self._reply(req, False, str(e))
        self._req = req
        if req.start_step is None or req.start_step <= self.forward_ct:
            self._begin(activities)
            return self._reply(req, True, "Start profiling.")
        return self._reply(req, True, f"Profiling will start at forward step {req.start_step}.")

    def step(self) -> None:
        """One forward pass was launched: start a waiting profile, or count the step and stop
        after ``num_steps``."""
        self.forward_ct += 1
        req = self._req
        if req is None:
            return
        if self._profile is None:
            if req.start_step is not None and self.forward_ct >= req.start_step:
                self._begin(_activities(req.activities))
            return
        self._profile.step()
        self._steps += 1
        if req.num_steps is not None and self._steps >= req.num_steps:
            self._stop()

    def _begin(self, activities: list[ProfilerActivity]) -> None:
        req = self._req
        assert req is not None, "a profile was asked for"
        self._profile = profile(activities=activities, with_stack=req.with_stack,
                                record_shapes=req.record_shapes)
        self._profile.__enter__()
        self._steps = 0
        logger.info("Profiling started (%s)", ", ".join(a.name for a in activities))

    def _stop(self) -> str:
        """Stop and write the trace; the message says where (or that nothing was recorded)."""
        req, prof = self._req, self._profile
        self._req, self._profile = None, None
        assert req is not None, "a profile is active"
        if prof is None:
            return "Profiling stopped before its start step: nothing was recorded."
        prof.__exit__(None, None, None)
        path = os.path.join(
            _output_dir(req),
            f"{req.profile_prefix or ''}{req.profile_id or time.time()}-pid{os.getpid()}"
            ".trace.json.gz",
        )
        prof.export_chrome_trace(path)
        logger.info("Profile of %d step(s) written to %s", self._steps, path)
        return f"Profile of {self._steps} step(s) written to {path}"

    @staticmethod
    def _reply(req: ProfileReq, success: bool, message: str) -> ProfileReqOutput:
        return ProfileReqOutput(success, message, req_id=req.req_id)


def _activities(names: list[str] | None) -> list[ProfilerActivity]:
    """The profiler activities for ``names`` (upstream's "CPU" / "GPU"); ValueError for others
    and for "GPU" without CUDA. Default: CPU, and GPU when CUDA is there."""
    if names is None:
        names = ["CPU", "GPU"] if torch.cuda.is_available() else ["CPU"]
    unknown = sorted(set(names) - set(_ACTIVITIES))
    if unknown:
        raise ValueError(f"profile activities {unknown} are not supported; use CPU and/or GPU")
    if "GPU" in names and not torch.cuda.is_available():
        raise ValueError("the GPU profile activity needs a CUDA device")
    if not names:
        raise ValueError("give at least one profile activity (CPU, GPU)")
    return [_ACTIVITIES[name] for name in dict.fromkeys(names)]


def _check_steps(req: ProfileReq) -> None:
    for name in ("start_step", "num_steps"):
        value = getattr(req, name)
        if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                  or value < (1 if name == "num_steps" else 0)):
            raise ValueError(f"{name} must be {'>= 1' if name == 'num_steps' else '>= 0'}, "
                             f"got {value!r}")


def _output_dir(req: ProfileReq) -> str:
    return req.output_dir or environ.torch_profiler_dir() or DEFAULT_PROFILER_DIR
