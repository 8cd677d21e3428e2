"""Issue 13, end to end: a detokenizer failure ends its request in the scheduler too, the
biggest logprob reply does not block ``/health``, and an Engine killed by SIGTERM leaves no IPC
directory and no child process.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from engine_test_utils import assert_kv_all_back, engine_state, wait_for

# ---- a detokenizer failure ends the request in the scheduler -----------------------------------
_PICKY_TOKENIZER = '''
from transformers import PreTrainedTokenizerFast


class PickyTokenizerFast(PreTrainedTokenizerFast):
    """Fails to decode for a request with spaces_between_special_tokens=False (the poison)."""

    def batch_decode(self, sequences, **kwargs):
        if kwargs.get("spaces_between_special_tokens") is False:
            raise ValueError("poisoned request")
        return super().batch_decode(sequences, **kwargs)
'''


def _picky_model(model_dir: Path, dest: Path) -> Path:
    """A copy of ``model_dir`` whose tokenizer (remote code) raises for poisoned requests."""
    shutil.copytree(model_dir, dest)
    (dest / "tokenization_picky.py").write_text(_PICKY_TOKENIZER)
    config_path = dest / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["auto_map"] = {"AutoTokenizer": [None, "tokenization_picky.PickyTokenizerFast"]}
    config_path.write_text(json.dumps(config))
    return dest


def _gone(state: dict[str, Any], rid: str) -> bool:
    return rid not in state["running_batch_rids"] and rid not in state["waiting_queue_rids"]


def test_detokenizer_failure_aborts_the_request_in_the_scheduler(
    tiny_model_dir: Callable[..., Path], tmp_path: Path
) -> None:
    import sglang as sgl  # here: conftest sets TRITON_INTERPRET first

    model = _picky_model(tiny_model_dir("llama"), tmp_path / "picky")
    params: dict[str, Any] = {"temperature": 0, "max_new_tokens": 300, "ignore_eos": True}
    poisoned = {**params, "max_new_tokens": 400, "spaces_between_special_tokens": False}
    healthy_ids = [11, 20, 30, 41]
    with sgl.Engine(model_path=str(model), trust_remote_code=True, random_seed=0,
                    enable_deterministic_inference=True) as engine:
        alone = engine.generate(input_ids=healthy_ids, sampling_params=params)
        with ThreadPoolExecutor(2) as pool:
            good = pool.submit(engine.generate, input_ids=healthy_ids, sampling_params=params,
                               rid="healthy")
            wait_for(lambda: "healthy" in engine_state(engine)["running_batch_rids"])
            chunks: list[dict] = []

            def poisoned_stream() -> None:
                for chunk in engine.generate(input_ids=[10, 20, 30, 40], rid="poisoned",
                                             sampling_params=poisoned, stream=True):
                    chunks.append(chunk)

            pool.submit(poisoned_stream).result(60)
            # The failed request leaves the scheduler at once (it would otherwise run its 400
            # tokens and outlive the healthy one), its KV back in the pool.
            wait_for(lambda: _gone(engine_state(engine), "poisoned"), timeout=10)
            assert not good.done()
            out = good.result(120)
        state = engine_state(engine)
        assert_kv_all_back(state)
        assert _gone(state, "poisoned") and _gone(state, "healthy")
    # One terminal output for the failed request: the last one, an error naming the cause.
    finals = [c["meta_info"]["finish_reason"] for c in chunks if c["meta_info"]["finish_reason"]]
    assert len(finals) == 1 and chunks[-1]["meta_info"]["finish_reason"] == finals[0]
    assert finals[0]["type"] == "abort" and "poisoned request" in finals[0]["message"]
    assert out["output_ids"] == alone["output_ids"] and len(out["output_ids"]) == 300
    assert out["meta_info"]["finish_reason"]["type"] == "length"
