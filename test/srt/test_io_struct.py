"""Every inter-process message survives the wire format (utils.dumps / loads) unchanged, and
the detokenizer forwards scheduler replies untouched (DESIGN §10)."""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any

import pytest

from sglang.srt.managers import io_struct
from sglang.srt.managers.detokenizer_manager import DetokenizerManager
from sglang.srt.managers.io_struct import PauseGenerationReqOutput, SchedulerReply
from sglang.srt.sampling.sampling_params import SamplingParams
from sglang.srt.utils import dumps, loads

_SAMPLES: dict[Any, Any] = {
    str: "text \u00e9",
    int: 7,
    float: 0.25,
    bool: True,
    SamplingParams: SamplingParams(max_new_tokens=3, stop=["x"]),
}


# Fields whose sample must stay unset for the message to be valid (its own checks).
_UNSET = {"GenerateReqInput": {"input_ids", *io_struct.UNSUPPORTED_GENERATE_FIELDS}}


def _sample(tp: Any) -> Any:
    """A non-default value of type ``tp`` (the first usable member of a union)."""
    if tp in _SAMPLES:
        return _SAMPLES[tp]
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        return _sample(next(a for a in typing.get_args(tp) if a is not type(None)))
    if origin is typing.Literal:
        return typing.get_args(tp)[0]
    if origin is list:
        return [_sample(typing.get_args(tp)[0])] if typing.get_args(tp) else []
    if origin is dict:
        return {"key": 1}
    if origin is tuple:
        return tuple(_sample(a) for a in typing.get_args(tp) if a is not Ellipsis)
    return {"any": [1, 2]}


def _messages() -> list[type]:
    return [
        cls
        for _, cls in inspect.getmembers(io_struct, inspect.isclass)
        if dataclasses.is_dataclass(cls) and cls.__module__ == io_struct.__name__
    ]


@pytest.mark.parametrize("cls", _messages(), ids=lambda c: c.__name__)
def test_message_round_trips(cls: type) -> None:
    hints = typing.get_type_hints(cls)
    unset = _UNSET.get(cls.__name__, set())
    kwargs = {
        f.name: _sample(hints[f.name])
        for f in dataclasses.fields(cls)
        if f.init and f.name not in unset
    }
    msg = cls(**kwargs)
    assert loads(dumps(msg)) == msg


def test_detokenizer_forwards_scheduler_replies_unchanged() -> None:
    reply = PauseGenerationReqOutput(success=True, mode="wait", num_waiting=2, req_id="r")
    forwarded = DetokenizerManager(None).forward_reply(loads(dumps(SchedulerReply(reply))))
    assert forwarded == reply


def test_generate_req_input_takes_upstreams_fields() -> None:
    """Code that builds upstream's GenerateReqInput (verl's server mode) runs: unset fields of
    features this engine lacks are accepted, set ones refused by name; routing and metrics
    hints accepted; upstream's nullable fields take their defaults."""
    req = io_struct.GenerateReqInput(
        rid="r", input_ids=[1, 2], sampling_params={}, return_logprob=None, image_data=None,
        return_hidden_states=False, token_ids_logprob=None, data_parallel_rank=0, priority=3)
    assert (req.return_logprob, req.logprob_start_len, req.top_logprobs_num) == (False, -1, 0)
    batch = io_struct.GenerateReqInput(input_ids=[[1], [2]], rid="job",
                                       return_logprob=[None, True])
    batch.normalize_batch_and_arguments()
    assert batch.rid == ["job_0", "job_1"] and batch.return_logprob == [False, True]
    for name in ("image_data", "return_hidden_states", "custom_logit_processor"):
        with pytest.raises(ValueError, match=name):
            io_struct.GenerateReqInput(input_ids=[1], **{name: [None, "x"]})
