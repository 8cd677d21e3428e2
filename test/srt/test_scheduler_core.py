"""The Scheduler core in-process (no sockets, no model forward): every control request in every
request state, every exit path; after each, the invariants hold with no flush and every request
ends exactly once with exactly the tokens an uninterrupted run produces."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from scheduler_test_utils import (
    FAKE_ENTROPY,
    FAKE_LOGPROB,
    OutputSink,
    assert_no_leak,
    control,
    expected_output,
    make_core,
    run_until_idle,
    submit,
)

from sglang.srt.managers.io_struct import (
    AbortReq,
    ContinueGenerationReqInput,
    FlushCacheReqInput,
    GetWeightsByNameReqInput,
    PauseGenerationReqInput,
    PauseStateOutput,
    ReleaseMemoryOccupationReqInput,
    ResumeMemoryOccupationReqInput,
    UpdateWeightFromDiskReqInput,
    UpdateWeightsFromTensorReqInput,
    UpdateWeightVersionReqInput,
)
from sglang.srt.managers.schedule_batch import ForwardMode, ReqStatus
from sglang.srt.managers.scheduler import Scheduler

PROMPTS = {
    "a": list(range(20, 28)),
    "b": list(range(40, 52)),
    "long": list(range(60, 100)),  # 40 tokens: three chunks of 16
}
MAX_NEW = 12


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def _submit_all(core: Scheduler, names: list[str], **request: Any) -> None:
    for name in names:
        submit(core, name, PROMPTS[name], MAX_NEW, **request)


def _steps(core: Scheduler, n: int) -> None:
    for _ in range(n):
        core.run_step()
        core.check_invariants()


# ---- request states ----------------------------------------------------------------------------
def _waiting(core: Scheduler, sink: OutputSink) -> None:
    _submit_all(core, ["a", "b"])
    assert [r.status for r in core.waiting_queue] == [ReqStatus.WAITING] * 2


def _chunked(core: Scheduler, sink: OutputSink) -> None:
    _submit_all(core, ["long", "a"])
    _steps(core, 1)
    assert core.chunked_req is not None and core.chunked_req.rid == "long"
    assert core.chunked_req.status is ReqStatus.PREFILLING


def _running(core: Scheduler, sink: OutputSink) -> None:
    _submit_all(core, ["a", "b"], return_logprob=True, return_entropy=True)
    _steps(core, 3)
    assert [r.status for r in core.running_batch.reqs] == [ReqStatus.RUNNING] * 2


def _paused_in_place(core: Scheduler, sink: OutputSink) -> None:
    _running(core, sink)
    assert control(core, sink, PauseGenerationReqInput(mode="in_place")).success
    assert [r.status for r in core.running_batch.reqs] == [ReqStatus.PAUSED] * 2


def _retracted(core: Scheduler, sink: OutputSink) -> None:
    _running(core, sink)
    reply = control(core, sink, PauseGenerationReqInput(mode="retract"))
    assert reply.num_retracted == 2
    assert [r.status for r in core.waiting_queue] == [ReqStatus.WAITING] * 2


STATES: dict[str, Callable[[Scheduler, OutputSink], None]] = {
    "waiting": _waiting,
    "chunked": _chunked,
    "running": _running,
    "paused_in_place": _paused_in_place,
    "retracted": _retracted,
}


# ---- control requests --------------------------------------------------------------------------
def _pause(mode: str) -> Callable[..., Any]:
    def send(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
        reply = control(core, sink, PauseGenerationReqInput(mode=mode))
        if mode == "wait" and reply is None:  # drains first: nothing new may start meanwhile
            waiting_before = [r.rid for r in core.waiting_queue]
            run_until_idle(core)
            reply = sink.replies[-1]
            assert [r.rid for r in core.waiting_queue] == waiting_before
        assert reply.success and core.pause.paused
        assert isinstance(sink.last_reply(PauseStateOutput), PauseStateOutput)
        return reply

    return send


def _flush(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
    reply = control(core, sink, FlushCacheReqInput())
    assert reply.success == (core.num_kv_holders() == 0)
    return reply


def _abort(**kwargs: Any) -> Callable[..., Any]:
    def send(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
        alive = {r.rid for r in core.waiting_queue + core.kv_holders()}
        reply = control(core, sink, AbortReq(**kwargs))
        if kwargs.get("abort_all"):
            assert reply.num_aborted == len(alive)
        target = {r for r in alive if kwargs.get("abort_all") or r.startswith(kwargs["rid"])}
        assert all(sink.by_rid[rid].finished_reasons[0]["type"] == "abort" for rid in target)
        assert {r.rid for r in core.waiting_queue + core.kv_holders()} == alive - target
        return reply

    return send


def _disk_update(path: str | None) -> Callable[..., Any]:
    def send(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
        update = UpdateWeightFromDiskReqInput(model_path=path or model_dir, weight_version="v2")
        reply = control(core, sink, update)
        assert reply.success == (path is None), reply.message
        assert core.weights.version == ("v2" if path is None else "default")
        return reply

    return send


def _tensor_update(good: bool) -> Callable[..., Any]:
    def send(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
        before = core.weights.model.model.norm.weight.detach().clone()
        shape = before.shape if good else (before.shape[0] + 1,)
        tensors = [("model.norm.weight", torch.full(shape, 0.5))]
        reply = control(core, sink, UpdateWeightsFromTensorReqInput(named_tensors=tensors))
        assert reply.success == good, reply.message
        after = core.weights.model.model.norm.weight
        assert torch.equal(after, torch.full_like(before, 0.5) if good else before)
        return reply

    return send


def _relabel(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
    reply = control(core, sink, UpdateWeightVersionReqInput(new_version="step-7"))
    assert reply.success and core.internal_state()["weight_version"] == "step-7"
    return reply


def _release_resume(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
    holders = core.num_kv_holders()
    reply = control(core, sink, ReleaseMemoryOccupationReqInput())
    assert reply.success == (holders == 0), reply.message
    if reply.success:
        assert not core.run_step(), "nothing may run while memory is released"
        core.check_invariants()
        assert control(core, sink, ResumeMemoryOccupationReqInput()).success
    return reply


def _read_weights(core: Scheduler, sink: OutputSink, model_dir: str) -> Any:
    reply = control(core, sink, GetWeightsByNameReqInput(name="model.norm.weight", truncate_size=3))
    assert reply.parameter is not None and len(reply.parameter) == 3
    return reply


CONTROLS: dict[str, Callable[..., Any]] = {
    "pause_abort": _pause("abort"),
    "pause_retract": _pause("retract"),
    "pause_in_place": _pause("in_place"),
    "pause_wait": _pause("wait"),
    "continue": lambda core, sink, d: control(core, sink, ContinueGenerationReqInput()),
    "flush": _flush,
    "abort_rid": _abort(rid="a"),
    "abort_prefix": _abort(rid="lo", match_prefix=True),
    "abort_all": _abort(abort_all=True),
    "update_from_disk": _disk_update(None),
    "update_from_disk_refused": _disk_update("/nonexistent/checkpoint"),
    "update_from_tensor": _tensor_update(True),
    "update_from_tensor_refused": _tensor_update(False),
    "relabel": _relabel,
    "release_resume_memory": _release_resume,
    "get_weights": _read_weights,
}


def _check_outcome(core: Scheduler, sink: OutputSink, rids: list[str]) -> None:
    """Every request ended exactly once, with an exact prefix of its uninterrupted tokens
    (all of them unless aborted), and aligned logprobs / entropies when asked."""
    vocab = core.model_config.vocab_size
    for rid in rids:
        rec = sink.by_rid[rid]
        assert len(rec.finished_reasons) == 1 and rec.messages_after_final == 0, (rid, rec)
        reason = rec.finished_reasons[0]
        expected = expected_output(PROMPTS[rid], MAX_NEW, vocab)
        if reason["type"] == "abort":
            assert rec.output_ids == expected[: len(rec.output_ids)], rid
        else:
            assert reason == {"type": "length", "length": MAX_NEW}
            assert rec.output_ids == expected, rid
        if rec.logprobs:
            assert rec.logprobs == [FAKE_LOGPROB] * len(rec.output_ids)
            assert rec.entropies == [FAKE_ENTROPY] * len(rec.output_ids)


@pytest.mark.parametrize("control_name", list(CONTROLS))
@pytest.mark.parametrize("state", list(STATES))
def test_control_in_every_state(model_dir: str, state: str, control_name: str) -> None:
    core, _, sink = make_core(model_dir, chunked_prefill_size=16)
    STATES[state](core, sink)
    rids = [r.rid for r in core.waiting_queue + core.kv_holders()]
    CONTROLS[control_name](core, sink, model_dir)
    core.check_invariants()  # no flush in between: a leak shows here
    if core.pause.paused and not core.pause.pending:
        tokens_before = {r.rid: len(r.output_ids) for r in core.kv_holders()}
        _steps(core, 3)
        assert {r.rid: len(r.output_ids) for r in core.kv_holders()} == tokens_before
    control(core, sink, ContinueGenerationReqInput())
    run_until_idle(core)
    _check_outcome(core, sink, rids)
    assert_no_leak(core)
    # The engine keeps serving: a new request runs to its full length.
    submit(core, "after", PROMPTS["a"], MAX_NEW)
    run_until_idle(core)
    assert sink.by_rid["after"].output_ids == expected_output(
        PROMPTS["a"], MAX_NEW, core.model_config.vocab_size
    )
    assert_no_leak(core)


# ---- exit paths --------------------------------------------------------------------------------
def test_kv_too_small_aborts_and_releases_everything(model_dir: str) -> None:
    """The issue's reproduction: a request that outgrows the whole pool is aborted, its slots
    and pool row come back without a flush, and the next request runs at once."""
    core, _, sink = make_core(model_dir, max_total_tokens=64)
    submit(core, "big", list(range(10, 20)), 200)
    run_until_idle(core)
    reason = sink.by_rid["big"].finished_reasons
    assert reason == [{"type": "abort", "message": "The KV cache is too small for this request"}]
    assert len(sink.by_rid["big"].output_ids) == 64 - 10 + 1
    assert_no_leak(core)
    submit(core, "next", list(range(30, 35)), 5)
    run_until_idle(core)
    assert sink.by_rid["next"].finished_reasons == [{"type": "length", "length": 5}]
    assert_no_leak(core)


def test_stop_token_and_length(model_dir: str) -> None:
    core, _, sink = make_core(model_dir)
    expected = expected_output(PROMPTS["a"], MAX_NEW, core.model_config.vocab_size)
    eos = core.model_config.eos_token_ids
    assert not eos & set(expected)  # only the stop token can end "a" early
    stop = {"stop_token_ids": [expected[3]]}
    submit(core, "a", PROMPTS["a"], MAX_NEW, sampling={**stop, "ignore_eos": False})
    submit(core, "b", PROMPTS["b"], 3)
    # ignore_eos turns off every token-based stop, stop_token_ids included (as upstream).
    submit(core, "c", PROMPTS["a"], MAX_NEW, sampling={**stop, "ignore_eos": True})
    run_until_idle(core)
    first_stop = expected.index(expected[3])
    assert sink.by_rid["a"].finished_reasons == [{"type": "stop", "matched": expected[3]}]
    assert sink.by_rid["a"].output_ids == expected[: first_stop + 1]
    assert sink.by_rid["c"].finished_reasons == [{"type": "length", "length": MAX_NEW}]
    assert sink.by_rid["c"].output_ids == expected
    assert sink.by_rid["b"].finished_reasons == [{"type": "length", "length": 3}]
    assert_no_leak(core)


@pytest.mark.parametrize(
    ("prompt", "sampling", "message"),
    [
        ([], {}, "The prompt is empty"),
        (list(range(10, 10 + 300)), {}, "fit in the context or KV pool"),
        (list(range(10, 50)), {"min_new_tokens": 250}, "plus min_new_tokens"),
    ],
)
def test_rejections_finish_at_once(
    model_dir: str, prompt: list[int], sampling: dict, message: str
) -> None:
    core, _, sink = make_core(model_dir)
    submit(core, "bad", prompt, 256, sampling=sampling)
    reasons = sink.by_rid["bad"].finished_reasons
    assert len(reasons) == 1 and reasons[0]["type"] == "abort"
    assert message in reasons[0]["message"]
    assert core.waiting_queue == []
    assert_no_leak(core)


def test_a_request_that_breaks_the_scheduler_is_finished_alone(model_dir: str) -> None:
    """An exception while taking one request in finishes that request with an error; the
    others, queued before and after, are served."""
    core, _, sink = make_core(model_dir)
    submit(core, "a", PROMPTS["a"], MAX_NEW)
    submit(core, "bad", PROMPTS["b"], MAX_NEW, sampling={"stop": ["\ud800"]})
    submit(core, "b", PROMPTS["b"], MAX_NEW)
    reasons = sink.by_rid["bad"].finished_reasons
    assert len(reasons) == 1 and reasons[0]["message"].startswith("Invalid request")
    run_until_idle(core)
    _check_outcome(core, sink, ["a", "b"])
    assert_no_leak(core)


def test_retraction_under_memory_pressure_keeps_tokens_exact(model_dir: str) -> None:
    """A pool so small that decode retracts again and again: every request still finishes
    with exactly its uninterrupted tokens, none duplicated or dropped."""
    core, _, sink = make_core(model_dir, max_total_tokens=64)
    prompts = {f"r{i}": list(range(20 + 10 * i, 28 + 10 * i)) for i in range(4)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, 40, return_logprob=True)
    run_until_idle(core)
    vocab = core.model_config.vocab_size
    for rid, prompt in prompts.items():
        rec = sink.by_rid[rid]
        assert rec.finished_reasons == [{"type": "length", "length": 40}]
        assert rec.output_ids == expected_output(prompt, 40, vocab)
        assert len(rec.logprobs) == 40
    assert sum(sink.by_rid[rid].num_retractions for rid in prompts) >= 2
    assert_no_leak(core)


def _prefill_sizes(core: Scheduler) -> list[int]:
    """Run ``core`` until idle; the number of requests in each prefill forward."""
    sizes = []
    while core.has_runnable_work():
        core.run_step()
        core.check_invariants()
        batch = core.last_batch
        if batch is not None and batch.forward_mode == ForwardMode.EXTEND:
            sizes.append(len(batch.reqs))
    return sizes


@pytest.mark.parametrize(("limit", "expected"), [(None, [4]), (2, [2, 2]), (1, [1] * 4)])
def test_prefill_max_requests_caps_each_prefill_batch(
    model_dir: str, limit: int | None, expected: list[int]
) -> None:
    """--prefill-max-requests N: no prefill forward holds more than N requests, and every
    request still ends with its uninterrupted tokens."""
    core, _, sink = make_core(model_dir, prefill_max_requests=limit)
    prompts = {f"r{i}": list(range(20 + 10 * i, 28 + 10 * i)) for i in range(4)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, MAX_NEW)
    assert _prefill_sizes(core) == expected
    vocab = core.model_config.vocab_size
    for rid, prompt in prompts.items():
        assert sink.by_rid[rid].output_ids == expected_output(prompt, MAX_NEW, vocab)
    assert_no_leak(core)


def test_prefill_max_requests_counts_the_chunked_prompt(model_dir: str) -> None:
    """The continuing chunked prompt takes a place: with a limit of 1 a short request does
    not join the long prompt's last (8-token) chunk, as it does without the limit."""
    for limit, expected in ((None, [1, 1, 2, 1]), (1, [1, 1, 1, 1, 1])):
        core, _, sink = make_core(model_dir, prefill_max_requests=limit, chunked_prefill_size=16)
        _submit_all(core, ["long", "a", "b"])
        assert _prefill_sizes(core) == expected, limit
        assert_no_leak(core)


def test_weight_update_refused_halfway_changes_nothing(model_dir: str) -> None:
    """One good and one bad tensor: refused as a whole, the good one not applied."""
    core, _, sink = make_core(model_dir)
    _running(core, sink)
    model = core.weights.model.model
    before = model.norm.weight.detach().clone()
    tensors = [
        ("model.norm.weight", torch.zeros_like(before)),
        ("model.layers.0.no_such_weight", torch.zeros(3)),
    ]
    reply = control(core, sink, UpdateWeightsFromTensorReqInput(named_tensors=tensors))
    assert not reply.success
    assert torch.equal(model.norm.weight, before)
    core.check_invariants()
    run_until_idle(core)
    _check_outcome(core, sink, ["a", "b"])
    assert_no_leak(core)


def test_pause_lease_expires_into_running(model_dir: str) -> None:
    core, _, sink = make_core(model_dir)
    _running(core, sink)
    control(core, sink, PauseGenerationReqInput(mode="in_place", timeout_s=1e-6))
    assert core.pause.paused
    core.run_step()  # the lease has expired by now: this turn continues, then decodes
    assert not core.pause.paused
    assert sink.last_reply(PauseStateOutput) == PauseStateOutput(paused=False)
    assert [r.status for r in core.running_batch.reqs] == [ReqStatus.RUNNING] * 2
    run_until_idle(core)
    _check_outcome(core, sink, ["a", "b"])
    assert_no_leak(core)


def test_invariant_check_catches_a_leak(model_dir: str) -> None:
    """The check is not vacuous: a slot taken behind the scheduler's back is reported."""
    core, _, _ = make_core(model_dir)
    core.check_invariants()
    core.kv.allocator.alloc_extend([0], [1], [-1])
    with pytest.raises(AssertionError, match="KV slots"):
        core.check_invariants()


def test_invariant_check_catches_a_page_with_two_owners(model_dir: str) -> None:
    """A page both held by a running request and listed free (the counts still add up) is
    reported, as is a page listed free twice."""
    core, _, _ = make_core(model_dir)
    submit(core, "a", PROMPTS["a"], 8)
    core.run_step()  # prefill: its prompt's pages go to the cache, locked by "a"
    core.run_step()  # decode: "a" now holds pages of its own
    core.check_invariants()
    allocator = core.kv.allocator
    held = int(core.kv.private_slots(core.running_batch.reqs[0])[0]) // allocator.page_size
    free = allocator._free_pages.clone()
    allocator._free_pages = torch.cat([free[:-1], torch.tensor([held])])  # swap one id
    with pytest.raises(AssertionError, match="two owners"):
        core.check_invariants()
    allocator._free_pages = torch.cat([free[:-1], free[:1]])  # one free page listed twice
    with pytest.raises(AssertionError, match="two owners"):
        core.check_invariants()
    allocator._free_pages = free
    core.check_invariants()


def test_start_up_weight_version_labels_tokens(model_dir: str) -> None:
    """``--weight-version`` labels the weights loaded at start-up, until a relabel."""
    core, _, sink = make_core(model_dir, weight_version="step-0")
    submit(core, "a", PROMPTS["a"], 3)
    run_until_idle(core)
    assert sink.by_rid["a"].weight_version == "step-0"
    assert core.internal_state()["weight_version"] == "step-0"
    for bad in ("", "x" * 257, "\ud800", "a\nb", 7):
        with pytest.raises(ValueError, match="weight-version"):
            make_core(model_dir, weight_version=bad)
