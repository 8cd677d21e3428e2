"""Units of slime's flattened buckets (``sglang.srt.weight_sync.tensor_bucket``, the
``flattened_bucket`` load format) and of custom weight loaders (``--custom-weight-loader``),
without an engine; test_compat_tokenizer_manager.py and test_compat_http.py run them end to end.
"""

from __future__ import annotations

import argparse
import dataclasses

import compat_weight_loaders
import pytest
import torch

from sglang.srt.configs.model_config import ModelConfig
from sglang.srt.managers.control_validation import check_control_request
from sglang.srt.managers.field_checks import InvalidRequestError
from sglang.srt.managers.io_struct import UpdateWeightsFromTensorReqInput
from sglang.srt.model_loader import get_model
from sglang.srt.model_loader import weight_update as wu
from sglang.srt.server_args import ServerArgs
from sglang.srt.utils import MultiprocessingSerializer
from sglang.srt.utils.multiprocessing_serializer import decode_named_tensors
from sglang.srt.weight_sync.tensor_bucket import (
    FlattenedTensorBucket,
    FlattenedTensorMetadata,
    bucket_to_named_tensors,
    check_bucket,
)

MIXED = [
    ("a.weight", torch.randn(3, 4)),
    ("b.weight", torch.randn(5).to(torch.bfloat16)),
    ("c.ids", torch.arange(6, dtype=torch.int64).reshape(2, 3)),
    ("d.mask", torch.tensor([True, False, True])),
    ("e.scalar", torch.tensor(1.5, dtype=torch.float16)),
]


def _same(got: list[tuple[str, torch.Tensor]], want: list[tuple[str, torch.Tensor]]) -> None:
    assert [n for n, _ in got] == [n for n, _ in want]
    for (_, g), (_, w) in zip(got, want, strict=True):
        assert g.dtype == w.dtype and g.shape == w.shape and torch.equal(g, w)


def test_bucket_round_trip_mixes_dtypes() -> None:
    bucket = FlattenedTensorBucket(named_tensors=MIXED)
    assert FlattenedTensorBucket.supports_multi_dtypes
    flat = bucket.get_flattened_tensor()
    assert flat.dim() == 1 and flat.dtype == torch.uint8
    meta = bucket.get_metadata()
    assert [dataclasses.astuple(m)[3:] for m in meta[:2]] == [(0, 48, 48), (48, 58, 10)]
    assert meta[0] == FlattenedTensorMetadata(
        "a.weight", torch.Size([3, 4]), torch.float32, 0, 48, 48
    )
    _same(bucket.reconstruct_tensors(), MIXED)
    # The receiving side: built from the flat tensor and metadata, as upstream's server does.
    again = FlattenedTensorBucket(flattened_tensor=flat, metadata=meta)
    _same(again.reconstruct_tensors(), MIXED)
    with pytest.raises(ValueError, match="empty"):
        FlattenedTensorBucket(named_tensors=[])
    with pytest.raises(ValueError, match="Must provide"):
        FlattenedTensorBucket(flattened_tensor=flat)


def test_bucket_payload_through_the_serializer() -> None:
    bucket = FlattenedTensorBucket(named_tensors=MIXED)
    payload = MultiprocessingSerializer.serialize(
        {"flattened_tensor": bucket.get_flattened_tensor(), "metadata": bucket.get_metadata()},
        output_str=True,
    )
    got = decode_named_tensors([payload], load_format="flattened_bucket")
    _same(got, MIXED)
    # Every tensor owns its storage: none keeps (or ships) the whole flat tensor.
    assert all(t.untyped_storage().nbytes() == t.numel() * t.element_size() for _, t in got)
    with pytest.raises(ValueError, match="load_format='flattened_bucket'"):
        decode_named_tensors([payload])
    plain = MultiprocessingSerializer.serialize(MIXED[:1])
    with pytest.raises(ValueError, match="flattened_bucket payload must be a dict"):
        decode_named_tensors([plain], load_format="flattened_bucket")


def test_legacy_single_dtype_bucket() -> None:
    # Older senders flattened in the tensors' own dtype, offsets in elements.
    a, b = torch.randn(2, 3), torch.randn(4)
    metadata = [
        {
            "name": "a",
            "shape": [2, 3],
            "dtype": torch.float32,
            "start_idx": 0,
            "end_idx": 6,
            "numel": 6,
        },
        {
            "name": "b",
            "shape": [4],
            "dtype": torch.float32,
            "start_idx": 6,
            "end_idx": 10,
            "numel": 4,
        },
    ]
    got = bucket_to_named_tensors(
        {"flattened_tensor": torch.cat([a.flatten(), b]), "metadata": metadata}
    )
    _same(got, [("a", a), ("b", b)])


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"end_idx": 10_000}, "outside the flattened tensor"),
        ({"start_idx": 40}, "end_idx - start_idx = 8 but numel = 48"),
        ({"numel": 44, "end_idx": 44}, "numel 44 but shape \\[3, 4\\] of torch.float32 needs 48"),
        ({"dtype": "float32"}, "dtype must be a torch.dtype"),
        ({"shape": [3, -4]}, "shape must be a list of non-negative ints"),
        ({"name": ""}, "name must be a non-empty string"),
        ({"start_idx": 1.5}, "start_idx must be a non-negative int"),
    ],
)
def test_bucket_metadata_is_checked(change: dict, message: str) -> None:
    bucket = FlattenedTensorBucket(named_tensors=MIXED)
    entries = [dataclasses.asdict(m) for m in bucket.get_metadata()]
    entries[0].update(change)
    with pytest.raises(ValueError, match=message):
        check_bucket(bucket.get_flattened_tensor(), entries)
    with pytest.raises(ValueError, match=message):
        FlattenedTensorBucket(
            flattened_tensor=bucket.flattened_tensor, metadata=entries
        ).reconstruct_tensors()


def test_bucket_shape_errors() -> None:
    flat = FlattenedTensorBucket(named_tensors=MIXED).get_flattened_tensor()
    with pytest.raises(ValueError, match="1-D"):
        check_bucket(flat.reshape(1, -1), [])
    with pytest.raises(ValueError, match="non-empty list"):
        check_bucket(flat, [])
    with pytest.raises(ValueError, match="lacks field 'numel'"):
        check_bucket(
            flat, [{"name": "a", "shape": [1], "dtype": torch.uint8, "start_idx": 0, "end_idx": 1}]
        )
    with pytest.raises(ValueError, match="missing: metadata"):
        bucket_to_named_tensors({"flattened_tensor": flat})
    legacy = {
        "flattened_tensor": torch.zeros(4),
        "metadata": [
            {
                "name": "i",
                "shape": [4],
                "dtype": torch.int64,
                "start_idx": 0,
                "end_idx": 4,
                "numel": 4,
            }
        ],
    }
    with pytest.raises(ValueError, match="does not fit a flattened tensor of torch.float32"):
        bucket_to_named_tensors(legacy)


def test_tensor_load_formats_at_the_edge() -> None:
    q = ("model.layers.0.self_attn.q_proj.weight", torch.zeros(1))
    for fmt in (None, "direct", "flattened_bucket", "pkg.module.func"):
        check_control_request(UpdateWeightsFromTensorReqInput([q], load_format=fmt))
    for fmt, message in (
        ("gguf", "not a tensor load format"),
        ("", "non-empty"),
        (3, "must be a string"),
    ):
        with pytest.raises(InvalidRequestError, match=message):
            check_control_request(UpdateWeightsFromTensorReqInput([q], load_format=fmt))


def test_custom_loader_resolution() -> None:
    listed = [
        "compat_weight_loaders.load_doubled",
        "compat_weight_loaders.NOT_CALLABLE",
        "compat_weight_loaders.missing",
        "no_such_module_xyz.f",
    ]
    assert wu.resolve_custom_loader(listed[0], listed) is compat_weight_loaders.load_doubled
    with pytest.raises(wu.WeightUpdateError, match=r"'pkg\.f' is not a registered custom"):
        wu.resolve_custom_loader("pkg.f", listed)
    with pytest.raises(wu.WeightUpdateError, match="lists: none"):
        wu.resolve_custom_loader("pkg.f", [])
    with pytest.raises(wu.WeightUpdateError, match="not callable"):
        wu.resolve_custom_loader(listed[1], listed)
    for path in listed[2:]:
        with pytest.raises(wu.WeightUpdateError, match="cannot import"):
            wu.resolve_custom_loader(path, listed)


def test_custom_loader_gets_the_model_and_may_load_a_subset(tiny_model_dir) -> None:
    model = get_model(ModelConfig(str(tiny_model_dir("llama"))), "cpu")
    q = "model.layers.0.self_attn.q_proj.weight"
    new = torch.randn(64, 64)
    wu.load_with_custom_loader(model, compat_weight_loaders.load_doubled, [(q, new)])
    assert torch.equal(torch.tensor(wu.get_weights_by_name(model, q, 1000)), new * 2)
    assert "load_weights" not in model.__dict__  # the partial default is gone afterwards
    with pytest.raises(ValueError):
        model.load_weights([(q, new)])  # strict again: a partial load is refused


def test_custom_weight_loader_server_arg() -> None:
    args = ServerArgs(model_path="m", device="cpu")
    assert args.custom_weight_loader == []
    args = ServerArgs(model_path="m", device="cpu", custom_weight_loader=["a.b", "c.d.e"])
    assert args.custom_weight_loader == ["a.b", "c.d.e"]
    # One path as a plain string (as SkyRL passes it) is a list of one.
    assert ServerArgs(
        model_path="m", device="cpu", custom_weight_loader="a.b"
    ).custom_weight_loader == ["a.b"]
    for bad in (["nodots"], ["a..b"], "nodots", [3], 3):
        with pytest.raises(ValueError, match="custom-weight-loader"):
            ServerArgs(model_path="m", device="cpu", custom_weight_loader=bad)
    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    ns = parser.parse_args(
        ["--model-path", "m", "--device", "cpu", "--custom-weight-loader", "a.b", "c.d"]
    )
    assert ServerArgs.from_cli_args(ns).custom_weight_loader == ["a.b", "c.d"]
