"""A prompt computed once is shared: a running request's prompt KV goes to the prefix cache as
soon as its prefill is done (ReqKV.share_computed), and waiting requests that begin with the
tokens a prefill batch computes wait a round for them (schedule_policy.SharedPrompts), as ``n``
samples of a prompt, RL groups of one prompt and questions behind one system prompt arrive.
Driven through the Scheduler core with the scripted worker: every request still ends once with
the tokens an uninterrupted run produces, and the invariants hold after every step."""

from __future__ import annotations

import pytest
from scheduler_test_utils import (
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
    PauseGenerationReqInput,
    UpdateWeightFromDiskReqInput,
)
from sglang.srt.managers.scheduler import Scheduler

PROMPT = list(range(100, 160))  # 60 tokens: more than the 32 that make copies wait
MAX_NEW = 10


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir) -> str:
    return str(tiny_model_dir("llama"))


def check_outputs(
    core: Scheduler, sink: OutputSink, rids_prompts: dict[str, list[int]], max_new: int = MAX_NEW
) -> None:
    vocab = core.model_config.vocab_size
    for rid, prompt in rids_prompts.items():
        rec = sink.by_rid[rid]
        assert rec.output_ids == expected_output(prompt, max_new, vocab), rid
        assert len(rec.finished_reasons) == 1 and rec.messages_after_final == 0, rid


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlap"])
def test_identical_prompts_in_one_batch_are_computed_once(model_dir: str, overlap: bool) -> None:
    """Also under the overlap schedule (CUDA's), where an extend step is committed before the
    next batch is chosen, so the copies find the prompt cached."""
    core, worker, sink = make_core(model_dir, overlap=overlap)
    other = list(range(300, 340))
    for i in range(4):
        submit(core, f"copy{i}", PROMPT, MAX_NEW)
    submit(core, "other", other, MAX_NEW)
    core.run_step()  # one prefill: the first copy and "other"; the three copies wait
    core.check_invariants()
    assert worker.extended_tokens == len(PROMPT) + len(other)
    assert sorted(r.rid for r in core.waiting_queue) == ["copy1", "copy2", "copy3"]
    run_until_idle(core)
    # the copies computed only their last prompt token (its logits give the first sample)
    assert worker.extended_tokens == len(PROMPT) + len(other) + 3
    check_outputs(core, sink, {**{f"copy{i}": PROMPT for i in range(4)}, "other": other})
    assert [sink.by_rid[f"copy{i}"].cached_tokens for i in range(4)] == [0] + [59] * 3
    assert sink.by_rid["other"].cached_tokens == 0
    assert_no_leak(core)


def test_a_running_requests_prompt_is_shared(model_dir: str) -> None:
    """A request arriving while the first one decodes takes its prompt from the cache; the
    first one's abort leaves the second one's (shared) KV intact."""
    core, worker, sink = make_core(model_dir)
    submit(core, "first", PROMPT, 40)
    core.run_step()
    core.run_step()  # "first" decodes, its prompt is cached and locked by it
    longer = PROMPT + [7, 8, 9]
    submit(core, "second", longer, MAX_NEW)
    core.run_step()
    core.check_invariants()
    second = next(r for r in core.running_batch.reqs if r.rid == "second")
    assert second.cached_tokens == len(PROMPT)
    assert worker.extended_tokens == len(PROMPT) + 3
    control(core, sink, AbortReq(rid="first"))
    run_until_idle(core)
    check_outputs(core, sink, {"second": longer})
    assert sink.by_rid["first"].finished_reasons[0]["type"] == "abort"
    assert_no_leak(core)


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_shared_prompts_through_pause(model_dir: str, mode: str) -> None:
    core, _, sink = make_core(model_dir)
    for i in range(3):
        submit(core, f"r{i}", PROMPT, MAX_NEW)
    core.run_step()
    core.run_step()  # the copies are admitted on the cached prompt
    core.run_step()
    assert control(core, sink, PauseGenerationReqInput(mode=mode)) is not None
    core.check_invariants()
    if mode != "in_place":
        assert control(core, sink, FlushCacheReqInput()).success
    assert control(core, sink, ContinueGenerationReqInput()) is not None
    run_until_idle(core)
    if mode == "abort":
        assert all(sink.by_rid[f"r{i}"].finished_reasons[0]["type"] == "abort" for i in range(3))
    else:
        check_outputs(core, sink, {f"r{i}": PROMPT for i in range(3)})
    assert_no_leak(core)


def test_no_sharing_across_a_weight_update(model_dir: str) -> None:
    """A prompt computed under the old weights is not handed to a request admitted after an
    update, even while the request that computed it still runs."""
    core, worker, sink = make_core(model_dir)
    submit(core, "old", PROMPT, 30)
    core.run_step()
    core.run_step()
    control(core, sink, PauseGenerationReqInput(mode="in_place"))
    reply = control(
        core, sink, UpdateWeightFromDiskReqInput(model_path=model_dir, flush_cache=False)
    )
    assert reply.success, reply.message
    control(core, sink, ContinueGenerationReqInput())
    submit(core, "new", PROMPT, MAX_NEW)
    run_until_idle(core)
    assert sink.by_rid["new"].cached_tokens == 0
    assert worker.extended_tokens == 2 * len(PROMPT)
    check_outputs(core, sink, {"new": PROMPT})
    check_outputs(core, sink, {"old": PROMPT}, max_new=30)
    assert_no_leak(core)


def test_prompt_logprobs_and_no_cache_do_not_wait(model_dir: str) -> None:
    """A copy that wants prompt logprobs from its start computes its prompt anyway, so it does
    not wait; without a prefix cache (--disable-radix-cache) nothing waits or is shared."""
    core, worker, sink = make_core(model_dir)
    submit(core, "a", PROMPT, MAX_NEW)
    submit(core, "b", PROMPT, MAX_NEW, return_logprob=True, logprob_start_len=0)
    core.run_step()
    assert not core.waiting_queue and worker.extended_tokens == 2 * len(PROMPT)
    run_until_idle(core)
    check_outputs(core, sink, {"a": PROMPT, "b": PROMPT})

    core, worker, sink = make_core(model_dir, disable_radix_cache=True)
    for i in range(3):
        submit(core, f"r{i}", PROMPT, MAX_NEW)
    core.run_step()
    assert not core.waiting_queue and worker.extended_tokens == 3 * len(PROMPT)
    run_until_idle(core)
    check_outputs(core, sink, {f"r{i}": PROMPT for i in range(3)})
    assert_no_leak(core)


def test_a_prompt_chunked_across_a_weight_update_is_not_shared(model_dir: str) -> None:
    """Chunks computed under the old weights and the new ones: none of it goes to the cache."""
    core, worker, sink = make_core(model_dir, chunked_prefill_size=16)
    submit(core, "mixed", PROMPT, MAX_NEW)
    core.run_step()  # the first chunk, under the old weights
    assert core.chunked_req is not None
    control(core, sink, PauseGenerationReqInput(mode="in_place"))
    reply = control(
        core, sink, UpdateWeightFromDiskReqInput(model_path=model_dir, flush_cache=False)
    )
    assert reply.success, reply.message
    control(core, sink, ContinueGenerationReqInput())
    while core.chunked_req is not None:
        core.run_step()
        core.check_invariants()
    submit(core, "after", PROMPT, MAX_NEW)
    run_until_idle(core)
    assert sink.by_rid["after"].cached_tokens == 0
    assert worker.extended_tokens == 2 * len(PROMPT)
    check_outputs(core, sink, {"mixed": PROMPT, "after": PROMPT})
    assert_no_leak(core)


SYSTEM = list(range(200, 240))  # 40 tokens: a system prompt the questions below begin with


def question(i: int, length: int = 5) -> list[int]:
    return [300 + 10 * i + j for j in range(length)]


def test_a_common_system_prompt_is_computed_once(model_dir: str) -> None:
    """Requests that only begin alike (one system prompt, different questions) wait a round for
    the first one's KV of the common part, then compute only their own questions; a request
    sharing fewer than 32 tokens with it does not wait."""
    core, worker, sink = make_core(model_dir)
    prompts = {f"q{i}": SYSTEM + question(i) for i in range(3)}
    prompts["brief"] = SYSTEM[:20] + question(5, 30)  # 20 tokens in common: computed now
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, MAX_NEW)
    core.run_step()
    core.check_invariants()
    assert worker.extended_tokens == len(prompts["q0"]) + len(prompts["brief"])
    assert sorted(r.rid for r in core.waiting_queue) == ["q1", "q2"]
    run_until_idle(core)
    assert worker.extended_tokens == sum(map(len, prompts.values())) - 2 * len(SYSTEM)
    check_outputs(core, sink, prompts)
    assert [sink.by_rid[rid].cached_tokens for rid in prompts] == [0, 40, 40, 0]
    assert_no_leak(core)


def test_only_tokens_the_batch_computes_make_requests_wait(model_dir: str) -> None:
    """With the system prompt already cached, two questions behind it wait for each other only
    when they have 32 more tokens in common, the ones the first one computes."""
    core, worker, sink = make_core(model_dir)
    submit(core, "warm", SYSTEM + [7], 2)
    run_until_idle(core)
    common = question(0, 35)
    prompts = {
        "a": SYSTEM + common + [1, 2],
        "b": SYSTEM + common + [3, 4],  # 35 uncached tokens in common with "a": waits
        "c": SYSTEM + common[:20] + question(6, 15),  # 20 uncached in common: computed now
    }
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, MAX_NEW)
    computed = worker.extended_tokens
    core.run_step()
    core.check_invariants()
    assert [r.rid for r in core.waiting_queue] == ["b"]
    assert worker.extended_tokens - computed == 37 + 35
    run_until_idle(core)
    assert worker.extended_tokens - computed == 37 + 35 + 2
    check_outputs(core, sink, prompts)
    assert [sink.by_rid[rid].cached_tokens for rid in prompts] == [40, 75, 40]
    assert_no_leak(core)


@pytest.mark.parametrize(("page_size", "waits"), [(16, True), (64, False)])
def test_shared_tokens_count_in_whole_pages(model_dir: str, page_size: int, waits: bool) -> None:
    """Only whole pages are cached: 40 common tokens are 2 pages of 16 (32 tokens, enough to
    wait for) but no page of 64."""
    core, worker, sink = make_core(model_dir, page_size=page_size)
    prompts = {f"q{i}": SYSTEM + question(i) for i in range(2)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, MAX_NEW)
    core.run_step()
    assert [r.rid for r in core.waiting_queue] == (["q1"] if waits else [])
    run_until_idle(core)
    check_outputs(core, sink, prompts)
    assert sink.by_rid["q1"].cached_tokens == (32 if waits else 0)
    assert worker.extended_tokens == 2 * 45 - sink.by_rid["q1"].cached_tokens
    assert_no_leak(core)


def test_the_same_tokens_behind_different_cached_prompts_are_not_shared(model_dir: str) -> None:
    """The same question at the same position behind two different cached system prompts: the
    second request has nothing to take from the first one's KV, so it does not wait."""
    core, worker, sink = make_core(model_dir)
    other_system = list(range(400, 440))
    submit(core, "warm1", SYSTEM + [7], 2)
    submit(core, "warm2", other_system + [7], 2)
    run_until_idle(core)
    prompts = {"x": SYSTEM + question(0, 35), "y": other_system + question(0, 35)}
    for rid, prompt in prompts.items():
        submit(core, rid, prompt, MAX_NEW)
    core.run_step()
    assert not core.waiting_queue
    run_until_idle(core)
    check_outputs(core, sink, prompts)
    assert [sink.by_rid[rid].cached_tokens for rid in prompts] == [40, 40]
    assert_no_leak(core)
