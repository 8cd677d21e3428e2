"""Llama/Qwen2/Qwen3 on our layers and torch-native attention vs transformers (CPU, tiny)."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from model_test_utils import (
    BatchBuilder,
    hf_greedy,
    hf_logits,
    load_from_hf,
    set_input_logprobs,
)
from transformers import (
    AutoModelForCausalLM,
    LlamaConfig,
    MistralConfig,
    MixtralConfig,
    Qwen2Config,
    Qwen2MoeConfig,
    Qwen3Config,
    Qwen3MoeConfig,
)

from sglang.srt.layers.attention import get_attention_backend_class, torch_native_backend
from sglang.srt.layers.attention.decode_kv_mirror import DecodeKVMirror, MirrorPlan
from sglang.srt.layers.attention.torch_native_backend import PagedDecodeMetadata, group_by_length
from sglang.srt.layers.cpu_prepack import enable_cpu_weight_prepack
from sglang.srt.layers.layernorm import RMSNorm
from sglang.srt.layers.linear import linear
from sglang.srt.layers.logits_processor import LogitsProcessor, last_token_rows
from sglang.srt.layers.rotary_embedding import get_rope
from sglang.srt.models import llama
from sglang.srt.models.registry import get_model_class

ARCHS = {
    "llama": (LlamaConfig, "LlamaForCausalLM", {}),
    "mistral": (MistralConfig, "MistralForCausalLM", {}),
    "qwen2": (Qwen2Config, "Qwen2ForCausalLM", {}),
    # head_dim 32 != hidden / heads = 16: the explicit head_dim must be honoured.
    "qwen3": (Qwen3Config, "Qwen3ForCausalLM", {"head_dim": 32}),
    # Mixture-of-experts blocks (layers/moe.py); layer 1 of the Qwen2-MoE model stays dense.
    "mixtral": (MixtralConfig, "MixtralForCausalLM", {"num_local_experts": 4}),
    "qwen2_moe": (
        Qwen2MoeConfig,
        "Qwen2MoeForCausalLM",
        {
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 48,
            "shared_expert_intermediate_size": 96,
            "mlp_only_layers": [1],
        },
    ),
    "qwen3_moe": (
        Qwen3MoeConfig,
        "Qwen3MoeForCausalLM",
        {
            "head_dim": 32,
            "num_experts": 8,
            "num_experts_per_tok": 3,
            "moe_intermediate_size": 48,
            "norm_topk_prob": True,
        },
    ),
}
PROMPTS = [[5, 17, 3, 99, 250, 8, 41], list(range(30, 43)), [200, 7, 7]]


def make_hf_model(arch: str, seed: int = 0, **overrides: object) -> torch.nn.Module:
    """A tiny random transformers model; norms and biases perturbed so loading them matters."""
    config_cls, arch_name, extra = ARCHS[arch]
    kwargs = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=320,
        max_position_embeddings=256,
        initializer_range=0.2,
        tie_word_embeddings=False,
        architectures=[arch_name],
    )
    kwargs.update(extra)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    hf_model = AutoModelForCausalLM.from_config(config_cls(**kwargs)).eval()
    with torch.no_grad():
        for param in hf_model.parameters():
            param.add_(torch.randn_like(param) * 0.05)
    return hf_model


@pytest.fixture(scope="module", params=sorted(ARCHS))
def models(request: pytest.FixtureRequest) -> tuple[torch.nn.Module, torch.nn.Module]:
    hf_model = make_hf_model(request.param)
    return hf_model, load_from_hf(get_model_class(hf_model.config.architectures), hf_model)


def test_prefill_last_token_logits_match_hf(models_both_linears) -> None:
    hf_model, model = models_both_linears
    builder = BatchBuilder(model.config)
    out = builder.run(model, builder.extend([(f"r{i}", p) for i, p in enumerate(PROMPTS)]))
    assert out.next_token_logits.shape == (3, model.config.vocab_size)
    assert out.next_token_logits.dtype == torch.float32
    expected = torch.stack([hf_logits(hf_model, p)[-1] for p in PROMPTS])
    torch.testing.assert_close(out.next_token_logits, expected, atol=1e-4, rtol=1e-4)
    assert out.input_token_logprobs is None


@pytest.fixture(params=["plain", "prepacked"])
def models_both_linears(
    request: pytest.FixtureRequest, models: tuple[torch.nn.Module, torch.nn.Module]
) -> tuple[torch.nn.Module, torch.nn.Module]:
    """Each model as loaded, and with the oneDNN-prepacked linear layers the model runner
    enables on CPU (the same parameters: packing copies them)."""
    hf_model, model = models
    if request.param == "prepacked":
        model = copy.deepcopy(model)
        enable_cpu_weight_prepack(model)
    return hf_model, model


def test_greedy_decode_matches_hf(models_both_linears) -> None:
    hf_model, model = models_both_linears
    num_steps = 6
    builder = BatchBuilder(model.config)
    rids = [f"r{i}" for i in range(len(PROMPTS))]
    out = builder.run(model, builder.extend(list(zip(rids, PROMPTS))))
    tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    step_logits = [[row] for row in out.next_token_logits]
    for _ in range(num_steps - 1):
        out = builder.run(model, builder.decode([(rid, t[-1]) for rid, t in zip(rids, tokens)]))
        for i, row in enumerate(out.next_token_logits):
            tokens[i].append(int(row.argmax()))
            step_logits[i].append(row)
    for i, prompt in enumerate(PROMPTS):
        expected_ids, expected_logits = hf_greedy(hf_model, prompt, num_steps)
        assert tokens[i] == expected_ids
        torch.testing.assert_close(
            torch.stack(step_logits[i]), torch.stack(expected_logits), atol=1e-4, rtol=1e-4
        )


def test_group_by_length() -> None:
    # Similar lengths (or too little padding to save) stay one group, in descending order.
    assert group_by_length([400, 420, 390]) == [[1, 0, 2]]
    assert group_by_length([100, 3, 40]) == [[0, 2, 1]]
    # A long tail is split off once padding it would waste >= _MIN_SAVED_SLOTS key slots.
    lens = [5000] + [100] * 8 + [40] * 2
    assert group_by_length(lens) == [[0], list(range(1, 11))]
    assert sorted(r for g in group_by_length([7, 1, 9000, 3000, 2]) for r in g) == [0, 1, 2, 3, 4]


def test_length_grouped_decode_matches_hf(models, monkeypatch: pytest.MonkeyPatch) -> None:
    """Force one SDPA group per length class; rows must still land in batch order."""
    hf_model, model = models
    monkeypatch.setattr(torch_native_backend, "_MIN_SAVED_SLOTS", 0)
    # The gather path (the CPU decode mirror refuses, as it does over its memory budget).
    monkeypatch.setattr(DecodeKVMirror, "plan", lambda self, forward_batch: None)
    prompts = [PROMPTS[2], PROMPTS[1], PROMPTS[0], [9]]  # lengths 3, 13, 7, 1
    builder = BatchBuilder(model.config, cpu_attention_kernel=False)
    rids = ["a", "b", "c", "d"]
    out = builder.run(model, builder.extend(list(zip(rids, prompts))))
    tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    batch = builder.decode([(r, t[0]) for r, t in zip(rids, tokens)])
    out = builder.run(model, batch)
    assert len(batch.attn_metadata.groups) >= 3
    for i, prompt in enumerate(prompts):
        expected = hf_logits(hf_model, prompt + tokens[i])[-1]
        torch.testing.assert_close(out.next_token_logits[i], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("kernel", [False, True], ids=["sdpa-mirror", "paged-kernel"])
def test_decode_follows_batch_changes(models, kernel: bool) -> None:
    """CPU decode (SDPA over the mirror, or the paged kernel over the pool) across steps whose
    batches drop, add and reorder requests, and a request that reuses a finished one's row and
    slots (its KV differs: the mirror must refill it)."""
    hf_model, model = models
    builder = BatchBuilder(model.config, max_reqs=3, cpu_attention_kernel=kernel)
    expected_meta = PagedDecodeMetadata if kernel else MirrorPlan
    seqs = {"a": list(PROMPTS[0]), "b": list(PROMPTS[1]), "c": list(PROMPTS[2])}

    def step(batch, rids: list[str]) -> None:
        out = builder.run(model, batch)
        for rid, row in zip(rids, out.next_token_logits):
            expected = hf_logits(hf_model, seqs[rid])[-1]
            torch.testing.assert_close(row, expected, atol=1e-4, rtol=1e-4)
            seqs[rid].append(int(row.argmax()))

    def decode(rids: list[str]) -> None:
        batch = builder.decode([(rid, seqs[rid][-1]) for rid in rids])
        step(batch, rids)
        assert isinstance(batch.attn_metadata, expected_meta)

    step(builder.extend([(rid, seqs[rid]) for rid in "abc"]), list("abc"))
    decode(list("abc"))
    decode(["c", "a"])  # b dropped, order changed
    builder.release("a")
    seqs["d"] = [11, 12, 13, 14, 15, 16, 17, 18]  # a's row and slots, other tokens
    step(builder.extend([("d", seqs["d"])]), ["d"])
    for rids in (["b", "c", "d"], ["d", "b"], ["b", "c", "d"]):
        decode(rids)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_rounds_like_hf(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    torch.manual_seed(0)
    hf_norm = LlamaRMSNorm(96, eps=1e-5).to(dtype)
    norm = RMSNorm(96, eps=1e-5).to(dtype)
    with torch.no_grad():
        hf_norm.weight.normal_()
        norm.weight.copy_(hf_norm.weight)
    x = (torch.randn(5, 96) * 4).to(dtype)
    residual = torch.randn(5, 96).to(dtype)
    assert torch.equal(norm(x), hf_norm(x))
    out, summed = norm(x, residual)
    assert torch.equal(summed, x + residual) and torch.equal(out, hf_norm(x + residual))


def test_linear_single_row() -> None:
    """One bfloat16 row without bias takes the mv path: the same values as F.linear."""
    torch.manual_seed(0)
    for out_features, in_features in ((2 * 1536, 576), (576, 1536), (960, 576), (4096, 576)):
        weight = torch.randn(out_features, in_features).bfloat16()
        x = torch.randn(1, in_features).bfloat16()
        assert torch.equal(linear(x, weight), F.linear(x, weight))


def test_chunked_prefill_equals_one_shot(models) -> None:
    _, model = models
    prompt, other = PROMPTS[1], PROMPTS[0]
    one_shot = BatchBuilder(model.config)
    expected = one_shot.run(model, one_shot.extend([("a", prompt)])).next_token_logits[0]

    chunked = BatchBuilder(model.config, seed=1)
    chunked.run(model, chunked.extend([("a", prompt[:6]), ("b", other)]))
    # Second chunk (cached prefix of 6) batched with a fresh request (no prefix).
    out = chunked.run(model, chunked.extend([("c", PROMPTS[2]), ("a", prompt[6:])]))
    torch.testing.assert_close(out.next_token_logits[1], expected, atol=1e-5, rtol=1e-5)

    token = int(expected.argmax())
    for _ in range(3):
        ref = one_shot.run(model, one_shot.decode([("a", token)])).next_token_logits[0]
        got = chunked.run(model, chunked.decode([("b", 1), ("a", token)])).next_token_logits[1]
        torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
        token = int(ref.argmax())


def test_input_logprobs_match_hf(models) -> None:
    hf_model, model = models
    top_k = 3
    builder = BatchBuilder(model.config)
    batch = builder.extend([("a", PROMPTS[0]), ("b", PROMPTS[1])])
    offset = len(PROMPTS[0])
    # Every prompt position of "a" except the last, and positions 2..5 of "b".
    rows = list(range(offset - 1)) + [offset + j for j in range(2, 6)]
    targets = PROMPTS[0][1:] + PROMPTS[1][3:7]
    set_input_logprobs(batch, rows, targets, top_k)
    out = builder.run(model, batch)

    ref_a = torch.log_softmax(hf_logits(hf_model, PROMPTS[0]), -1)[: offset - 1]
    ref_b = torch.log_softmax(hf_logits(hf_model, PROMPTS[1]), -1)[2:6]
    ref = torch.cat([ref_a, ref_b])
    expected = ref.gather(1, torch.tensor(targets)[:, None]).squeeze(1)
    torch.testing.assert_close(out.input_token_logprobs, expected, atol=1e-4, rtol=1e-4)
    ref_top = ref.topk(top_k, dim=-1)
    torch.testing.assert_close(out.input_top_logprobs_val, ref_top.values, atol=1e-4, rtol=1e-4)
    assert torch.equal(out.input_top_logprobs_idx, ref_top.indices)
    assert out.next_token_logits.shape[0] == 2


def test_input_logprobs_after_cached_prefix() -> None:
    hf_model = make_hf_model("llama")
    model = load_from_hf(get_model_class(["LlamaForCausalLM"]), hf_model)
    prompt = PROMPTS[1]
    builder = BatchBuilder(model.config)
    builder.run(model, builder.extend([("a", prompt[:5])]))
    batch = builder.extend([("a", prompt[5:])])
    set_input_logprobs(batch, list(range(len(prompt) - 6)), prompt[6:])
    out = builder.run(model, batch)
    ref = torch.log_softmax(hf_logits(hf_model, prompt), -1)[5:-1]
    expected = ref.gather(1, torch.tensor(prompt[6:])[:, None]).squeeze(1)
    torch.testing.assert_close(out.input_token_logprobs, expected, atol=1e-4, rtol=1e-4)
    assert out.input_top_logprobs_val is None


def _mlp_rows(model: torch.nn.Module) -> tuple[list[int], object]:
    """The row count each decoder layer's MLP sees, in call order, and the hooks' remover."""
    seen: list[int] = []
    handles = [
        layer.mlp.register_forward_hook(lambda _m, args, _out: seen.append(args[0].shape[0]))
        for layer in model.model.layers
    ]
    return seen, lambda: [h.remove() for h in handles]


def test_prefill_runs_last_layer_past_attention_on_last_tokens(
    models, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Only each request's last token feeds the LM head, so the last layer's output projection
    and MLP run on those rows alone; its K/V are still written for every token (the decode
    after it matches the full pass) and the logits are the full pass's."""
    _, model = models
    reqs = [(f"r{i}", p) for i, p in enumerate(PROMPTS)]
    num_tokens = sum(len(p) for p in PROMPTS)
    pruned, full = BatchBuilder(model.config), BatchBuilder(model.config)
    seen, remove = _mlp_rows(model)
    try:
        out = pruned.run(model, pruned.extend(reqs))
        assert seen == [num_tokens] * (len(model.model.layers) - 1) + [len(PROMPTS)]
        seen.clear()
        with monkeypatch.context() as patch:  # the model's layers without the row selection
            patch.setattr(llama, "last_token_rows", lambda _batch: None)
            ref = full.run(model, full.extend(reqs))
        assert seen == [num_tokens] * len(model.model.layers)
    finally:
        remove()
    torch.testing.assert_close(out.next_token_logits, ref.next_token_logits, atol=1e-5, rtol=1e-5)
    tokens = [(rid, int(t)) for (rid, _), t in zip(reqs, out.next_token_logits.argmax(-1))]
    got = pruned.run(model, pruned.decode(tokens)).next_token_logits
    expected = full.run(model, full.decode(tokens)).next_token_logits
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)


def test_last_layer_keeps_every_row_where_they_are_needed() -> None:
    """Prompt logprobs need every row's hidden state, one-token extends and decode have only
    last rows, and a LoRA step's row groups index all tokens: no selection there."""
    hf_model = make_hf_model("llama")
    model = load_from_hf(get_model_class(["LlamaForCausalLM"]), hf_model)
    builder = BatchBuilder(model.config)
    seen, remove = _mlp_rows(model)
    try:
        batch = builder.extend([("a", PROMPTS[0]), ("b", PROMPTS[2])])
        set_input_logprobs(batch, [0, 1], PROMPTS[0][1:3])
        builder.run(model, batch)
        assert seen == [10, 10]
        seen.clear()
        builder.run(model, builder.extend([("c", [4]), ("d", [9])]))
        builder.run(model, builder.decode([("a", 3), ("b", 4)]))
        assert seen == [2, 2, 2, 2]
    finally:
        remove()
    batch = builder.extend([("e", PROMPTS[1]), ("f", PROMPTS[2])])
    assert last_token_rows(batch).tolist() == [12, 15]
    batch.lora_names = [None, None]
    assert last_token_rows(batch).tolist() == [12, 15]
    batch.lora_names = [None, "adapter"]
    assert last_token_rows(batch) is None


ROPE_CASES = {
    "linear": {"rope_type": "linear", "factor": 4.0},
    "llama3": {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 32,
    },
    "yarn": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "dynamic": {"rope_type": "dynamic", "factor": 2.0},
}


@pytest.mark.parametrize("case", sorted(ROPE_CASES))
def test_llama_rope_scaling_matches_hf(case: str) -> None:
    rope_parameters = {"rope_theta": 10000.0, **ROPE_CASES[case]}
    hf_model = make_hf_model("llama", rope_parameters=rope_parameters)
    model = load_from_hf(get_model_class(["LlamaForCausalLM"]), hf_model)
    prompt = list(range(1, 120, 3))  # 40 tokens: long enough for scaled frequencies to matter
    builder = BatchBuilder(model.config)
    out = builder.run(model, builder.extend([("a", prompt)]))
    expected_ids, expected_logits = hf_greedy(hf_model, prompt, 3)
    torch.testing.assert_close(out.next_token_logits[0], expected_logits[0], atol=1e-4, rtol=1e-4)
    for step in (1, 2):
        out = builder.run(model, builder.decode([("a", expected_ids[step - 1])]))
        torch.testing.assert_close(
            out.next_token_logits[0], expected_logits[step], atol=1e-4, rtol=1e-4
        )


def test_rope_scaling_changes_output() -> None:
    """Guards the test above: the scaled and plain models must actually differ."""
    prompt = list(range(1, 120, 3))
    plain = hf_logits(make_hf_model("llama"), prompt)[-1]
    scaled_params = {"rope_theta": 10000.0, **ROPE_CASES["llama3"]}
    scaled = hf_logits(make_hf_model("llama", rope_parameters=scaled_params), prompt)[-1]
    assert (plain - scaled).abs().max() > 1e-2


def test_partial_rotary_leaves_tail_untouched() -> None:
    head_dim, positions = 16, torch.tensor([0, 3, 9])
    partial = get_rope(head_dim, 10000.0, 32, None, partial_rotary_factor=0.5)
    full_of_head = get_rope(8, 10000.0, 32, None)
    q, k = torch.randn(3, 2 * head_dim), torch.randn(3, head_dim)
    q_out, k_out = partial(positions, q, k)
    q_heads, q_out_heads = q.view(3, 2, head_dim), q_out.view(3, 2, head_dim)
    assert torch.equal(q_out_heads[..., 8:], q_heads[..., 8:])
    expected_head, _ = full_of_head(positions, q_heads[..., :8].reshape(3, 16), k[:, :8])
    torch.testing.assert_close(q_out_heads[..., :8].reshape(3, 16), expected_head)
    assert not torch.allclose(k_out[:, :8], k[:, :8])


def test_llama_with_attention_and_mlp_bias() -> None:
    hf_model = make_hf_model("llama", attention_bias=True, mlp_bias=True)
    model = load_from_hf(get_model_class(["LlamaForCausalLM"]), hf_model)
    assert model.model.layers[0].self_attn.o_proj.bias is not None
    builder = BatchBuilder(model.config)
    out = builder.run(model, builder.extend([("a", PROMPTS[1])]))
    expected = hf_logits(hf_model, PROMPTS[1])[-1]
    torch.testing.assert_close(out.next_token_logits[0], expected, atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("tied", [True, False])
def test_tied_and_untied_embeddings(tied: bool) -> None:
    hf_model = make_hf_model("qwen3", tie_word_embeddings=tied)
    state = {n: t for n, t in hf_model.state_dict().items() if not (tied and n == "lm_head.weight")}
    model = get_model_class(["Qwen3ForCausalLM"])(hf_model.config)
    model.load_weights(state.items())
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tied
    builder = BatchBuilder(model.config)
    out = builder.run(model.eval(), builder.extend([("a", PROMPTS[0])]))
    expected = hf_logits(hf_model, PROMPTS[0])[-1]
    torch.testing.assert_close(out.next_token_logits[0], expected, atol=1e-4, rtol=1e-4)


def test_load_weights_rejects_unexpected_and_missing() -> None:
    hf_model = make_hf_model("llama")
    state = hf_model.state_dict()
    model_cls = get_model_class(["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="unexpected weight 'model.bogus.weight'"):
        model_cls(hf_model.config).load_weights(
            [*state.items(), ("model.bogus.weight", state["model.norm.weight"])]
        )
    missing = {
        n: t
        for n, t in state.items()
        if n not in ("model.norm.weight", "model.layers.1.self_attn.k_proj.weight")
    }
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.self_attn\.qkv_proj\.weight\[k\]"
    ) as err:
        model_cls(hf_model.config).load_weights(missing.items())
    assert "model.norm.weight" in str(err.value)
    with pytest.raises(ValueError, match="shape mismatch"):
        model_cls(hf_model.config).load_weights([("model.norm.weight", torch.ones(3))])


def test_partial_weight_update_with_strict_false() -> None:
    hf_model = make_hf_model("qwen2")
    model = load_from_hf(get_model_class(["Qwen2ForCausalLM"]), hf_model)
    new_bias = torch.full((2 * 16,), 0.5)  # k bias: num_kv_heads * head_dim
    model.load_weights([("model.layers.0.self_attn.k_proj.bias", new_bias)], strict=False)
    bias = model.model.layers[0].self_attn.qkv_proj.bias
    q_size = 4 * 16
    assert torch.equal(bias[q_size : q_size + 32], new_bias)
    expected_q = hf_model.state_dict()["model.layers.0.self_attn.q_proj.bias"]
    assert torch.equal(bias[:q_size], expected_q)


@pytest.mark.parametrize("linears", ["plain", "prepacked", "prepacked_fp32"])
def test_bfloat16_prefill_and_decode(linears: str) -> None:
    hf_model = make_hf_model("qwen3")
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # how the model loader builds a bf16 model
    try:
        model = get_model_class(["Qwen3ForCausalLM"])(hf_model.config)
    finally:
        torch.set_default_dtype(before)
    model.load_weights(hf_model.state_dict().items())
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.rotary_emb._cos_sin.dtype == torch.float32
    if linears != "plain":
        enable_cpu_weight_prepack(model, upcast_bf16=linears == "prepacked_fp32")
    builder = BatchBuilder(model.config, dtype=torch.bfloat16)
    rids = ["a", "b", "c"]
    out = builder.run(model, builder.extend(list(zip(rids, PROMPTS))))
    assert out.next_token_logits.dtype == torch.float32
    tokens = [[int(t)] for t in out.next_token_logits.argmax(-1)]
    for _ in range(4):
        out = builder.run(model, builder.decode([(r, t[-1]) for r, t in zip(rids, tokens)]))
        for i, row in enumerate(out.next_token_logits):
            tokens[i].append(int(row.argmax()))
    assert builder.kv_pool.k_buffer[0].dtype == torch.bfloat16
    expected = [hf_greedy(hf_model, p, 5)[0] for p in PROMPTS]
    first_agree = sum(t[0] == e[0] for t, e in zip(tokens, expected))
    total_agree = sum(a == b for t, e in zip(tokens, expected) for a, b in zip(t, e))
    assert first_agree >= 2 and total_agree >= 10, (tokens, expected)


def test_logits_softcapping() -> None:
    class Config:
        final_logit_softcapping = 2.0

    batch = BatchBuilder(ARCHS["llama"][0](num_hidden_layers=1, num_key_value_heads=2)).extend(
        [("a", [1, 2, 3])]
    )
    hidden, weight = torch.randn(3, 8), torch.randn(5, 8) * 10
    out = LogitsProcessor(Config())(hidden, weight, batch)
    torch.testing.assert_close(out.next_token_logits[0], 2.0 * torch.tanh(weight @ hidden[2] / 2))
    assert out.next_token_logits.abs().max() <= 2.0


def test_model_registry() -> None:
    assert get_model_class(["Qwen2ForCausalLM"]).__name__ == "Qwen2ForCausalLM"
    assert get_model_class(["Nope", "MistralForCausalLM"]).__name__ == "MistralForCausalLM"
    with pytest.raises(ValueError, match="FooForCausalLM.*LlamaForCausalLM"):
        get_model_class(["FooForCausalLM"])


def test_attention_backend_registry() -> None:
    assert get_attention_backend_class("torch_native").__name__ == "TorchNativeAttnBackend"
    assert get_attention_backend_class("triton").__name__ == "TritonAttnBackend"
    with pytest.raises(ValueError, match="not available on this build"):
        get_attention_backend_class("flashinfer")
    with pytest.raises(ValueError, match="torch_native"):
        get_attention_backend_class("nonexistent")
