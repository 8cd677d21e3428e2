"""Endpoints and fields upstream SGLang's clients use (docs/compatibility.md), against a real
server on a tiny model: /get_load, /server_info, /model_info, /update_weights_from_tensor over
HTTP, stop_regex, and JSON errors for what we do not serve."""

from __future__ import annotations

import dataclasses
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch
from server_test_utils import ServerProcess

import sglang
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

GREEDY = {"temperature": 0, "max_new_tokens": 24, "ignore_eos": True}
Q_PROJ = "model.layers.0.self_attn.q_proj.weight"
K_PROJ = "model.layers.0.self_attn.k_proj.weight"
DOUBLED = "compat_weight_loaders.load_doubled"


@pytest.fixture(scope="module")
def server(tiny_model_dir: Callable[..., Path]) -> Iterator[ServerProcess]:
    # The custom loader lives in test/srt/compat_weight_loaders.py: put it on the path.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(
            [str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
        with ServerProcess(tiny_model_dir("llama"), "--skip-server-warmup",
                           "--enable-memory-saver", "--disable-cuda-graph",
                           "--custom-weight-loader", DOUBLED) as srv:
            yield srv


def _get(server: ServerProcess, path: str) -> httpx.Response:
    return httpx.get(server.url + path, timeout=60)


def _post(server: ServerProcess, path: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(server.url + path, json=body, timeout=60)


def test_get_load_as_sglang_router_reads_it(server: ServerProcess) -> None:
    load = _get(server, "/get_load")
    assert load.status_code == 200
    (entry,) = load.json()
    assert entry["dp_rank"] == 0
    assert entry["num_reqs"] == entry["num_waiting_reqs"] == 0
    assert entry["num_tokens"] >= 0 and entry["ts_tic"] > 0


def test_v1_loads_as_slime_reads_it(server: ServerProcess) -> None:
    body = _get(server, "/v1/loads?include=core,disagg,queues").json()
    (entry,) = body["loads"]
    assert body["dp_rank_count"] == 1 and body["version"] == sglang.__version__
    assert entry["dp_rank"] == 0 and entry["num_total_reqs"] == entry["num_running_reqs"] == 0
    assert entry["max_total_num_tokens"] > 0 and 0 <= entry["token_usage"] <= 1
    assert body["aggregate"]["total_reqs"] == 0
    assert _get(server, "/v1/loads?dp_rank=3").json()["loads"] == []


def test_new_info_names_match_the_old(server: ServerProcess) -> None:
    new, old = _get(server, "/server_info").json(), _get(server, "/get_server_info").json()
    assert new["version"] == old["version"] == sglang.__version__
    assert new["model_path"] == old["model_path"]
    assert _get(server, "/model_info").json() == _get(server, "/get_model_info").json()


def test_update_weights_from_tensor_over_http(server: ServerProcess) -> None:
    original = torch.tensor(_post(server, "/get_weights_by_name",
                                  {"name": Q_PROJ, "truncate_size": 10**6}).json())
    new = torch.randn_like(original)
    payload = MultiprocessingSerializer.serialize([(Q_PROJ, new)], output_str=True)
    out = _post(server, "/update_weights_from_tensor",
                {"serialized_named_tensors": [payload], "flush_cache": True,
                 "weight_version": "v2"})
    assert out.status_code == 200, out.text
    assert out.json()["success"] is True
    got = _post(server, "/get_weights_by_name", {"name": Q_PROJ, "truncate_size": 10**6})
    assert torch.equal(torch.tensor(got.json()), new)
    assert _get(server, "/model_info").json()["weight_version"] == "v2"
    # Refusals are 400s that say why, and change nothing.
    bad_name = MultiprocessingSerializer.serialize([("no.such.weight", new)], output_str=True)
    refused = _post(server, "/update_weights_from_tensor",
                    {"serialized_named_tensors": [bad_name]})
    assert refused.status_code == 400 and refused.json()["success"] is False
    garbage = _post(server, "/update_weights_from_tensor", {"serialized_named_tensors": ["%"]})
    assert garbage.status_code == 400 and "base64" in garbage.json()["message"]
    unknown = _post(server, "/update_weights_from_tensor",
                    {"serialized_named_tensors": [payload], "tp_rank_map": {}})
    assert unknown.status_code == 400 and "tp_rank_map" in unknown.json()["error"]["message"]
    restore = MultiprocessingSerializer.serialize([(Q_PROJ, original)], output_str=True)
    assert _post(server, "/update_weights_from_tensor",
                 {"serialized_named_tensors": [restore]}).status_code == 200


def _weight(server: ServerProcess, name: str) -> torch.Tensor:
    return torch.tensor(_post(server, "/get_weights_by_name",
                              {"name": name, "truncate_size": 10**6}).json())


def _bucket_payload(named: list[tuple[str, torch.Tensor]], metadata: list | None = None) -> str:
    bucket = FlattenedTensorBucket(named_tensors=named)
    return MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(),
         "metadata": metadata if metadata is not None else bucket.get_metadata()},
        output_str=True)


def test_flattened_bucket_over_http_as_slime_sends_it(server: ServerProcess) -> None:
    originals = [(Q_PROJ, _weight(server, Q_PROJ)), (K_PROJ, _weight(server, K_PROJ))]
    news = [(name, torch.randn_like(w)) for name, w in originals]
    out = _post(server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [_bucket_payload(news)], "load_format": "flattened_bucket",
        "flush_cache": False, "weight_version": "bucket-7"})
    assert out.status_code == 200, out.text
    for name, tensor in news:
        assert torch.equal(_weight(server, name), tensor)
    assert _get(server, "/model_info").json()["weight_version"] == "bucket-7"
    # Metadata that does not fit: a 400 with the reason, nothing changed.
    bad = [dataclasses.replace(m) for m in FlattenedTensorBucket(named_tensors=originals).metadata]
    bad[0].end_idx = 10**9
    refused = _post(server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [_bucket_payload(originals, bad)],
        "load_format": "flattened_bucket"})
    assert refused.status_code == 400
    assert "outside the flattened tensor" in refused.json()["message"]
    # A bucket sent without its load_format is refused, saying which to use.
    plain = _post(server, "/update_weights_from_tensor",
                  {"serialized_named_tensors": [_bucket_payload(originals)]})
    assert plain.status_code == 400 and "flattened_bucket" in plain.json()["message"]
    for name, tensor in news:
        assert torch.equal(_weight(server, name), tensor)
    restore = _post(server, "/update_weights_from_tensor", {
        "serialized_named_tensors": [_bucket_payload(originals)],
        "load_format": "flattened_bucket"})
    assert restore.status_code == 200, restore.text


def test_custom_weight_loader_over_http(server: ServerProcess) -> None:
    original = _weight(server, Q_PROJ)
    payload = MultiprocessingSerializer.serialize([(Q_PROJ, original)], output_str=True)
    out = _post(server, "/update_weights_from_tensor",
                {"serialized_named_tensors": [payload], "load_format": DOUBLED})
    assert out.status_code == 200, out.text
    assert torch.equal(_weight(server, Q_PROJ), original * 2)
    refused = _post(server, "/update_weights_from_tensor",
                    {"serialized_named_tensors": [payload], "load_format": "evil.module.func"})
    assert refused.status_code == 400
    assert "'evil.module.func' is not a registered custom weight loader" in (
        refused.json()["message"])
    assert _post(server, "/update_weights_from_tensor",
                 {"serialized_named_tensors": [payload]}).status_code == 200
    assert torch.equal(_weight(server, Q_PROJ), original)


def test_stop_regex_stops_with_the_pattern_as_matched(server: ServerProcess) -> None:
    baseline = _post(server, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": GREEDY})
    text = baseline.json()["text"]
    target = text[len(text) // 2: len(text) // 2 + 2]
    # Not a literal: upstream trims the text only at a matched pattern found verbatim in it.
    pattern = f"{re.escape(target[0])}(?:{re.escape(target[1])})"
    params = {**GREEDY, "stop_regex": [r"\A\b\Z", pattern]}  # the first never matches
    out = _post(server, "/generate", {"input_ids": [5, 6, 7, 8], "sampling_params": params})
    meta = out.json()["meta_info"]
    assert meta["finish_reason"] == {"type": "stop", "matched": pattern}
    assert meta["completion_tokens"] < GREEDY["max_new_tokens"]
    assert target in out.json()["text"] and text.startswith(out.json()["text"])
    chat = _post(server, "/v1/completions", {
        "prompt": [5, 6, 7, 8], "max_tokens": 24, "temperature": 0, "ignore_eos": True,
        "stop_regex": pattern,
    }).json()
    assert chat["choices"][0]["finish_reason"] == "stop"
    assert chat["choices"][0]["matched_stop"] == pattern
    bad = _post(server, "/generate", {"input_ids": [5], "sampling_params": {"stop_regex": "("}})
    assert bad.status_code == 400 and "stop_regex" in bad.json()["error"]["message"]


def test_unknown_endpoint_is_a_json_404(server: ServerProcess) -> None:
    out = _get(server, "/v1/loads_of_nothing")
    assert out.status_code == 404
    assert "message" in out.json()["error"]
