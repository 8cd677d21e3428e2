"""Frontend unit tests that need no scheduler: validation, detokenization, output assembly,
and the TokenizerManager's request routing against an in-process fake scheduler."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import zmq
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from sglang.srt.hf_transformers_utils import get_tokenizer
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.io_struct import (
    AbortReq,
    AbortReqOutput,
    BatchStrOutput,
    BatchTokenIDOutput,
    FlushCacheReqInput,
    FlushCacheReqOutput,
    GenerateReqInput,
    GetInternalStateReq,
    GetInternalStateReqOutput,
    SchedulerErrorOutput,
    TokenizedGenerateReqInput,
)
from sglang.srt.managers.tokenizer_manager import TokenizerManager
from sglang.srt.managers.tokenizer_req_state import ReqState
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.server_args import PortArgs, ServerArgs
from sglang.srt.utils import dumps, get_zmq_socket, loads

CONTEXT_LEN = 64
SCHED_INFO = {"context_length": CONTEXT_LEN, "vocab_size": 258, "max_req_input_len": 40}
TEXT = "héllo wörld 日本語 🙂 end"


def _save(tok: Tokenizer, path: str) -> str:
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")
    hf_tok.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def byte_tok_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Byte-level BPE without merges: every byte is one token, so é, 日 and 🙂 span 2-4 ids."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=258,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer)
    return _save(tok, str(tmp_path_factory.mktemp("byte_tok")))


@pytest.fixture(scope="module")
def byte_tok(byte_tok_dir: str):
    return get_tokenizer(byte_tok_dir)


@pytest.fixture(scope="module")
def space_tok(tmp_path_factory: pytest.TempPathFactory):
    """SentencePiece-style (Metaspace) tokenizer: a token decoded alone loses its space."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    trainer = trainers.BpeTrainer(vocab_size=120, special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(["hello world the quick brown fox jumps over a lazy dog"] * 4, trainer)
    return get_tokenizer(_save(tok, str(tmp_path_factory.mktemp("space_tok"))))


def _token_msg(rids, ids, reasons, stop_len=0, no_trim=False, skip=True) -> BatchTokenIDOutput:
    n = len(rids)
    return BatchTokenIDOutput(
        rids=rids, finished_reasons=reasons, decode_ids=ids, skip_special_tokens=[skip] * n,
        spaces_between_special_tokens=[True] * n, no_stop_trim=[no_trim] * n,
        stop_str_max_len=[stop_len] * n, prompt_tokens=[3] * n,
        completion_tokens=[len(x) for x in ids], cached_tokens=[0] * n, retraction_counts=[0] * n,
    )


def _feed_one_by_one(detok, ids, finish, **kw) -> list[str]:
    deltas = []
    for k, token_id in enumerate(ids):
        reason = finish if k == len(ids) - 1 else None
        deltas.append(detok.handle_batch_token_id_output(
            _token_msg(["r"], [[token_id]], [reason], **kw)).output_strs[0])
    return deltas


# ---- detokenizer ---------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["byte_tok", "space_tok"])
def test_incremental_decode_matches_full_decode(which, request) -> None:
    tok = request.getfixturevalue(which)
    text = TEXT if which == "byte_tok" else "hello world the lazy fox"
    ids = tok.encode(text, add_special_tokens=False)
    # Decoding each id alone is wrong for both (partial bytes / lost spaces): offsets matter.
    assert "".join(tok.decode([i]) for i in ids) != text
    deltas = _feed_one_by_one(DetokenizerManager(tok), ids, {"type": "length", "length": len(ids)})
    assert "".join(deltas) == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)  # no partial UTF-8 character ever emitted
    if which == "byte_tok":
        assert "" in deltas[:-1]  # some multi-byte character was held back


def test_detokenizer_batches_rids_and_drops_finished_state(byte_tok) -> None:
    detok = DetokenizerManager(byte_tok)
    a, b = byte_tok.encode("abc"), byte_tok.encode("xyz")
    out = detok.handle_batch_token_id_output(_token_msg(["a", "b"], [a[:2], b], [None, None]))
    assert out.output_strs == ["ab", "xyz"] and out.output_ids == [a[:2], b]
    out = detok.handle_batch_token_id_output(
        _token_msg(["a"], [a[2:]], [{"type": "length", "length": 3}]))
    assert out.output_strs == ["c"] and set(detok.states) == {"b"}


def test_stop_string_hold_back_and_trim(byte_tok) -> None:
    ids = byte_tok.encode("ab STOP", add_special_tokens=False)  # one id per character
    finish = {"type": "stop", "matched": "STOP"}
    deltas = _feed_one_by_one(DetokenizerManager(byte_tok), ids, finish, stop_len=4)
    # While running the last 3 characters are withheld, so "S", "ST", "STO" never show.
    assert deltas[:4] == ["", "", "", "a"] and deltas[4:] == ["b", " ", ""]
    assert "".join(deltas) == "ab "
    kept = _feed_one_by_one(DetokenizerManager(byte_tok), ids, finish, stop_len=4, no_trim=True)
    assert "".join(kept) == "ab STOP" and kept[-1] == "STOP"


def test_stop_token_id_is_cut_from_text_not_ids(byte_tok) -> None:
    ids = byte_tok.encode("hi!", add_special_tokens=False)
    finish = {"type": "stop", "matched": ids[-1]}
    out = DetokenizerManager(byte_tok).handle_batch_token_id_output(
        _token_msg(["r"], [ids], [finish]))
    assert out.output_strs == ["hi"] and out.output_ids == [ids]
    out = DetokenizerManager(byte_tok).handle_batch_token_id_output(
        _token_msg(["r"], [ids], [finish], no_trim=True))
    assert out.output_strs == ["hi!"]


def test_skip_special_tokens_and_skip_tokenizer_init(byte_tok) -> None:
    ids = [0, *byte_tok.encode("ok", add_special_tokens=False), 1]
    done = {"type": "length", "length": 4}
    detok = DetokenizerManager(byte_tok)
    assert detok.handle_batch_token_id_output(_token_msg(["r"], [ids], [done])).output_strs == [
        "ok"
    ]
    raw = detok.handle_batch_token_id_output(_token_msg(["r"], [ids], [done], skip=False))
    assert raw.output_strs == ["<s>ok</s>"]
    passthrough = DetokenizerManager(None).handle_batch_token_id_output(
        _token_msg(["r"], [ids], [None]))
    assert passthrough.output_strs == [""] and passthrough.output_ids == [ids]


# ---- output assembly -----------------------------------------------------------------------
def _str_msg(rid: str, text: str, ids: list[int], reason=None, **fields) -> BatchStrOutput:
    return BatchStrOutput(
        rids=[rid], finished_reasons=[reason], output_strs=[text], output_ids=[ids],
        prompt_tokens=[3], completion_tokens=[fields.pop("completion", len(ids))],
        cached_tokens=[1], retraction_counts=[0], **fields,
    )


def test_req_state_accumulates_logprobs_and_entropy(byte_tok) -> None:
    req = TokenizedGenerateReqInput(
        rid="r", input_text=None, input_ids=[5, 6, 7], sampling_params=SamplingParams(),
        return_logprob=True, logprob_start_len=1, top_logprobs_num=2, return_entropy=True)
    ids_a, ids_b = byte_tok.encode("a", add_special_tokens=False), byte_tok.encode(
        "b", add_special_tokens=False)
    state = ReqState(req, asyncio.Event(), None, lambda ids: byte_tok.batch_decode(
        [[i] for i in ids]), has_text=True)
    state.apply(_str_msg(
        "r", "a", ids_a, output_token_logprobs_val=[[-0.5]], output_token_logprobs_idx=[ids_a],
        output_top_logprobs_val=[[[-0.5, -1.5]]], output_top_logprobs_idx=[[[ids_a[0], 7]]],
        input_token_logprobs_val=[[None, -2.0]], input_token_logprobs_idx=[[6, 7]],
        input_top_logprobs_val=[[None, [-2.0, -3.0]]], input_top_logprobs_idx=[[None, [7, 8]]],
        output_token_entropy_val=[[1.25]]), 0)
    running = state.to_output()
    assert running["meta_info"]["finish_reason"] is None and running["text"] == "a"
    state.apply(_str_msg(
        "r", "b", ids_b, {"type": "length", "length": 2}, completion=2,
        output_token_logprobs_val=[[-0.25]], output_token_logprobs_idx=[ids_b],
        output_top_logprobs_val=[[[-0.25, -2.5]]], output_top_logprobs_idx=[[[ids_b[0], 9]]],
        input_token_logprobs_val=[[]], input_token_logprobs_idx=[[]],
        input_top_logprobs_val=[[]], input_top_logprobs_idx=[[]],
        output_token_entropy_val=[[0.5]]), 0)
    out = state.to_output()
    meta = out["meta_info"]
    assert out["text"] == "ab" and out["output_ids"] == ids_a + ids_b
    assert meta["finish_reason"] == {"type": "length", "length": 2}
    assert meta["output_token_logprobs"] == [[-0.5, ids_a[0], "a"], [-0.25, ids_b[0], "b"]]
    assert meta["input_token_logprobs"] == [[None, 6, byte_tok.decode([6])],
                                            [-2.0, 7, byte_tok.decode([7])]]
    assert meta["output_top_logprobs"][1] == [
        [-0.25, ids_b[0], "b"], [-2.5, 9, byte_tok.decode([9])]
    ]
    assert meta["input_top_logprobs"][0] is None and len(meta["input_top_logprobs"][1]) == 2
    assert meta["output_token_entropy"] == [1.25, 0.5]
    assert meta["completion_tokens"] == 2 and meta["cached_tokens"] == 1
    assert meta["output_token_logprobs_length"] == 2 and meta["reasoning_tokens"] == 0
    assert meta["weight_versions"] == [{"version": "default", "start": 0, "end": 2}]
    assert running["output_ids"] == ids_a  # earlier snapshots are not mutated later


def test_reasoning_tokens_count_up_to_the_think_end_token() -> None:
    """meta_info["reasoning_tokens"] (upstream's): the output up to and including the first
    reasoning-end token, all of it until that token comes; 0 without a reasoning parser."""
    req = TokenizedGenerateReqInput(rid="r", input_text=None, input_ids=[5],
                                    sampling_params=SamplingParams())
    state = ReqState(req, asyncio.Event(), None, None, has_text=False, think_end_id=9)
    state.apply(_str_msg("r", "", [4, 4, 4]), 0)
    assert state.to_output()["meta_info"]["reasoning_tokens"] == 3
    state.apply(_str_msg("r", "", [4, 9, 1, 9], completion=7), 0)
    meta = state.to_output()["meta_info"]
    assert meta["reasoning_tokens"] == 5 and "output_token_logprobs_length" not in meta
    plain = ReqState(req, asyncio.Event(), None, None, has_text=False)
    plain.apply(_str_msg("r", "", [9, 9]), 0)
    assert plain.to_output()["meta_info"]["reasoning_tokens"] == 0


def test_think_end_id_is_the_markers_token() -> None:
    from sglang.srt.managers.tokenizer_manager import _think_end_id

    vocab = {"<unk>": 0, "a": 1, "</think>": 2}
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>")
    assert _think_end_id(tok, "qwen3") == 2 and _think_end_id(tok, None) is None
    del vocab["</think>"]
    tok = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="<unk>")),
        unk_token="<unk>")
    assert _think_end_id(tok, "deepseek-r1") is None  # not one token: not counted
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        _think_end_id(tok, "nope")


def test_req_state_without_text_options() -> None:
    req = TokenizedGenerateReqInput(rid="r", input_text=None, input_ids=[1],
                                    sampling_params=SamplingParams(), return_logprob=True)
    state = ReqState(req, asyncio.Event(), None, None, has_text=False)
    state.apply(_str_msg("r", "", [4], {"type": "stop", "matched": 4},
                         output_token_logprobs_val=[[-1.0]], output_token_logprobs_idx=[[4]]), 0)
    out = state.to_output()
    assert "text" not in out and out["output_ids"] == [4]
    assert out["meta_info"]["output_token_logprobs"] == [[-1.0, 4, None]]
    assert "output_top_logprobs" not in out["meta_info"]
    assert "output_token_entropy" not in out["meta_info"]


# ---- validation ----------------------------------------------------------------------------
@pytest.fixture()
def tm(byte_tok_dir: str) -> TokenizerManager:
    return TokenizerManager(ServerArgs(model_path=byte_tok_dir), PortArgs.init_new(), SCHED_INFO)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"input_ids": []}, "empty"),
        ({"text": ""}, "empty"),
        ({"input_ids": [1, 258]}, "258"),
        ({"input_ids": [1, -1]}, "out of range"),
        ({"input_ids": [1] * CONTEXT_LEN}, "context length"),
        ({"input_ids": [1] * 41}, "maximum request input length"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature"),
        ({"input_ids": [1], "sampling_params": {"bogus": 1}}, "bogus"),
        ({"input_ids": [1], "sampling_params": {"stop_token_ids": [999]}}, "stop_token_ids"),
        ({"input_ids": [1, 2], "return_logprob": True, "logprob_start_len": 3}, "logprob_start"),
        ({"input_ids": [[1], [2]], "rid": ["x", "x"]}, "Duplicate"),
        ({"input_ids": [[1], [2]], "sampling_params": [{}]}, "sampling_params"),
    ],
)
def test_validation_errors(tm: TokenizerManager, kwargs: dict, message: str) -> None:
    obj = GenerateReqInput(**kwargs)
    with pytest.raises(ValueError, match=message):
        obj.normalize_batch_and_arguments()
        tm._tokenize_and_validate(obj)


def test_normalization_clamps_and_expands(tm: TokenizerManager) -> None:
    # The default budget (128) is clamped to the context; an explicit one that does not fit is
    # refused, as upstream does.
    obj = GenerateReqInput(text="héllo", rid="p", sampling_params={
        "n": 3, "temperature": None, "stop": "END"})
    obj.normalize_batch_and_arguments()
    reqs, parents = tm._tokenize_and_validate(obj)
    assert [r.rid for r in reqs] == ["p_0", "p_1", "p_2"] and parents == ["p"] * 3
    prompt_len = len(reqs[0].input_ids)
    assert reqs[0].input_ids == tm.tokenizer.encode("héllo")
    assert all(r.sampling_params.max_new_tokens == CONTEXT_LEN - prompt_len for r in reqs)
    too_long = GenerateReqInput(text="héllo", sampling_params={"max_new_tokens": 1000})
    too_long.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="exceeds the model's maximum context length"):
        tm._tokenize_and_validate(too_long)
    fits = GenerateReqInput(text="héllo",
                            sampling_params={"max_new_tokens": CONTEXT_LEN - prompt_len - 1})
    fits.normalize_batch_and_arguments()
    assert tm._tokenize_and_validate(fits)[0][0].sampling_params.max_new_tokens == (
        CONTEXT_LEN - prompt_len - 1)
    assert reqs[0].sampling_params.temperature == 1.0 and reqs[0].sampling_params.n == 1
    assert reqs[0].sampling_params.stop_strs == ["END"]
    unbounded = GenerateReqInput(input_ids=[1, 2], sampling_params={"max_new_tokens": None})
    unbounded.normalize_batch_and_arguments()
    assert tm._tokenize_and_validate(unbounded)[0][0].sampling_params.max_new_tokens == 62


def test_text_needs_a_tokenizer(byte_tok_dir: str) -> None:
    args = ServerArgs(model_path=byte_tok_dir, skip_tokenizer_init=True)
    manager = TokenizerManager(args, PortArgs.init_new(), SCHED_INFO)
    assert manager.tokenizer is None
    obj = GenerateReqInput(text="hi")
    obj.normalize_batch_and_arguments()
    with pytest.raises(ValueError, match="input_ids"):
        manager._tokenize_and_validate(obj)


# ---- routing against a fake scheduler ------------------------------------------------------
class FakeScheduler(threading.Thread):
    """Plays scheduler + detokenizer on the ZMQ endpoints of ``port_args``.

    A request gets ``max_new_tokens`` ids ``(last prompt id + k + 1) % 258`` with text "<id>",
    one message per token when streaming, else one message; ``max_new_tokens == 50`` requests
    are held until aborted.
    """

    def __init__(self, port_args: PortArgs) -> None:
        super().__init__(daemon=True)
        self.ctx = zmq.Context()
        self.pull = get_zmq_socket(self.ctx, zmq.PULL, port_args.scheduler_input_ipc_name, True)
        self.push = get_zmq_socket(self.ctx, zmq.PUSH, port_args.tokenizer_ipc_name, False)
        self.received: list = []
        self.held: dict[str, TokenizedGenerateReqInput] = {}
        self.stopped = threading.Event()

    def run(self) -> None:
        while not self.stopped.is_set():
            if self.pull.poll(20):
                self.handle(loads(self.pull.recv()))
        self.pull.close()
        self.push.close()
        self.ctx.term()

    def send(self, obj) -> None:
        self.push.send(dumps(obj))

    def handle(self, msg) -> None:
        self.received.append(msg)
        if isinstance(msg, TokenizedGenerateReqInput):
            if msg.sampling_params.max_new_tokens == 50:
                self.held[msg.rid] = msg
                return
            num_new = msg.sampling_params.max_new_tokens
            ids = [(msg.input_ids[-1] + k + 1) % 258 for k in range(num_new)]
            chunks = [[i] for i in ids] if msg.stream else [ids]
            for k, chunk in enumerate(chunks):
                done = {"type": "length", "length": len(ids)} if k == len(chunks) - 1 else None
                self.send(_str_msg(msg.rid, "".join(f"<{i}>" for i in chunk), chunk, done,
                                   completion=len(chunk) * (k + 1)))
        elif isinstance(msg, AbortReq):
            rids = list(self.held) if msg.abort_all else [r for r in self.held if r == msg.rid]
            for rid in rids:
                del self.held[rid]
                self.send(_str_msg(rid, "", [], {"type": "abort", "message": "Request aborted"}))
            self.send(AbortReqOutput(req_id=msg.req_id, num_aborted=len(rids)))
        elif isinstance(msg, FlushCacheReqInput):
            self.send(FlushCacheReqOutput(success=not self.held, req_id=msg.req_id))
        elif isinstance(msg, GetInternalStateReq):
            self.send(GetInternalStateReqOutput({"running_batch_rids": sorted(self.held)},
                                                req_id=msg.req_id))


def _run_with_fake(tok_dir: str, body) -> FakeScheduler:
    """Run ``body(tm, fake)`` in a fresh loop with a started manager and a fake scheduler."""
    port_args = PortArgs.init_new()
    fake = FakeScheduler(port_args)
    fake.start()

    async def main() -> None:
        manager = TokenizerManager(ServerArgs(model_path=tok_dir), port_args, SCHED_INFO)
        manager.start()
        try:
            await asyncio.wait_for(body(manager, fake), 30)
        finally:
            await manager.close()

    try:
        asyncio.run(main())
    finally:
        fake.stopped.set()
        fake.join(5)
    return fake


async def _collect(manager: TokenizerManager, **kwargs) -> list:
    return [out async for out in manager.generate_request(GenerateReqInput(**kwargs))]


def test_single_batch_stream_and_n(byte_tok_dir: str) -> None:
    async def body(manager: TokenizerManager, fake: FakeScheduler) -> None:
        [single] = await _collect(manager, input_ids=[10], sampling_params={"max_new_tokens": 3})
        assert single["output_ids"] == [11, 12, 13] and single["text"] == "<11><12><13>"
        assert single["meta_info"]["finish_reason"] == {"type": "length", "length": 3}
        [batch] = await _collect(manager, input_ids=[[20], [30]], rid=["a", "b"],
                                 sampling_params={"max_new_tokens": 2})
        assert [o["meta_info"]["id"] for o in batch] == ["a", "b"]
        assert [o["output_ids"] for o in batch] == [[21, 22], [31, 32]]
        chunks = await _collect(manager, input_ids=[5], stream=True,
                                sampling_params={"max_new_tokens": 3})
        assert chunks[-1]["output_ids"] == [6, 7, 8] and chunks[-1]["text"] == "<6><7><8>"
        for prev, nxt in zip(chunks, chunks[1:]):  # cumulative: each chunk extends the last
            assert nxt["output_ids"][: len(prev["output_ids"])] == prev["output_ids"]
            assert prev["meta_info"]["finish_reason"] is None
        streamed = await _collect(manager, input_ids=[[1], [2]], stream=True,
                                  sampling_params={"max_new_tokens": 2})
        finals = {o["index"]: o for o in streamed if o["meta_info"]["finish_reason"]}
        assert finals[0]["output_ids"] == [2, 3] and finals[1]["output_ids"] == [3, 4]
        [copies] = await _collect(manager, input_ids=[7], rid="q",
                                  sampling_params={"max_new_tokens": 1, "n": 2})
        assert [o["meta_info"]["id"] for o in copies] == ["q_0", "q_1"]
        assert not manager.rid_to_state

    fake = _run_with_fake(byte_tok_dir, body)
    assert sum(isinstance(m, TokenizedGenerateReqInput) for m in fake.received) == 8


def test_abort_control_calls_and_duplicate_rid(byte_tok_dir: str) -> None:
    async def body(manager: TokenizerManager, fake: FakeScheduler) -> None:
        held = asyncio.ensure_future(
            _collect(manager, input_ids=[3], rid="h", sampling_params={"max_new_tokens": 50}))
        while "h" not in fake.held:
            await asyncio.sleep(0.01)
        with pytest.raises(ValueError, match="Duplicate request id"):
            await _collect(manager, input_ids=[3], rid="h")
        assert await manager.get_internal_state() == [{"running_batch_rids": ["h"]}]
        assert (await manager.flush_cache()).success is False
        assert await manager.abort_request_async("h") == 1
        [out] = await held
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
        assert (await manager.flush_cache()).success is True

    _run_with_fake(byte_tok_dir, body)


def test_client_disconnect_aborts(byte_tok_dir: str) -> None:
    class GoneClient:
        async def is_disconnected(self) -> bool:
            return True

    async def body(manager: TokenizerManager, fake: FakeScheduler) -> None:
        obj = GenerateReqInput(input_ids=[3], rid="d", sampling_params={"max_new_tokens": 50})
        outs = [o async for o in manager.generate_request(obj, GoneClient())]
        assert outs == [] and not manager.rid_to_state
        while "d" in fake.held:
            await asyncio.sleep(0.01)

    fake = _run_with_fake(byte_tok_dir, body)
    assert [m.rid for m in fake.received if isinstance(m, AbortReq)] == ["d"]


def test_scheduler_death_fails_pending_and_new_calls(byte_tok_dir: str) -> None:
    async def body(manager: TokenizerManager, fake: FakeScheduler) -> None:
        held = asyncio.ensure_future(
            _collect(manager, input_ids=[3], sampling_params={"max_new_tokens": 50}))
        while not fake.held:
            await asyncio.sleep(0.01)
        fake.send(SchedulerErrorOutput("CUDA out of memory"))
        with pytest.raises(RuntimeError, match="scheduler died: CUDA out of memory"):
            await held
        with pytest.raises(RuntimeError, match="scheduler died"):
            await manager.flush_cache()
        with pytest.raises(RuntimeError, match="scheduler died"):
            await _collect(manager, input_ids=[3])

    _run_with_fake(byte_tok_dir, body)


def test_dead_process_is_noticed(byte_tok_dir: str) -> None:
    class DeadProc:
        name, exitcode = "sglang-detokenizer", -9

        def is_alive(self) -> bool:
            return False

    async def body(manager: TokenizerManager, fake: FakeScheduler) -> None:
        pending = asyncio.ensure_future(
            _collect(manager, input_ids=[3], sampling_params={"max_new_tokens": 50}))
        await asyncio.sleep(0.05)
        manager.watch_processes([DeadProc()])
        with pytest.raises(RuntimeError, match="sglang-detokenizer exited with code -9"):
            await pending

    _run_with_fake(byte_tok_dir, body)


def test_a_manager_never_closed_is_collected_without_blocking(tmp_path) -> None:
    """A started TokenizerManager whose loop ended without close() (a caller that forgot it)
    must not block the garbage collection that frees it: zmq's term() waits for open sockets,
    so its sockets are closed by a finalizer. In a subprocess, where a hang is a timeout."""
    script = tmp_path / "collect.py"
    script.write_text(
        "import asyncio, gc, sys\n"
        f"sys.path.insert(0, {str(Path(__file__).resolve().parents[2] / 'python')!r})\n"
        "from sglang.srt.managers.tokenizer_manager import TokenizerManager\n"
        "from sglang.srt.server_args import PortArgs, ServerArgs\n"
        "args = ServerArgs(model_path='m', device='cpu', skip_tokenizer_init=True)\n"
        "info = {'context_length': 64, 'vocab_size': 100, 'max_req_input_len': 60}\n"
        "tm = TokenizerManager(args, PortArgs.init_new(), info)\n"
        "async def run():\n"
        "    tm.start()\n"
        "    await asyncio.sleep(0.05)\n"
        "asyncio.run(run())\n"
        "del tm\n"
        "gc.collect()\n"
        "print('collected')\n"
    )
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "collected" in done.stdout, done.stderr
