"""Tokenizer and generation-config helpers on top of transformers.

A model path is either an HF directory (config.json, tokenizer files) or a single ``.gguf`` file
whose metadata carries the tokenizer and chat template. Only local paths are accepted: the
engine never downloads.
"""

from __future__ import annotations

import json
import logging
import os

from transformers import AutoTokenizer, PreTrainedTokenizerBase

logger = logging.getLogger(__name__)


def is_gguf_path(path: str) -> bool:
    """True when ``path`` names a GGUF file (by extension; existence is not checked)."""
    return path.lower().endswith(".gguf")


def get_tokenizer(tokenizer_path: str, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """Load the tokenizer of an HF directory or of a ``.gguf`` file.

    The returned tokenizer pads on the left (batched prompts end at the same position).
    Raises ``FileNotFoundError`` when the path does not exist and ``ValueError`` when it holds
    no tokenizer transformers can read.
    """
    path = os.path.expanduser(tokenizer_path)
    if not os.path.exists(path):
        raise FileNotFoundError(f"tokenizer path {tokenizer_path!r} does not exist")
    try:
        if is_gguf_path(path) and os.path.isfile(path):
            # transformers builds a fast tokenizer from the GGUF's tokenizer.* metadata.
            tokenizer = AutoTokenizer.from_pretrained(
                os.path.dirname(os.path.abspath(path)),
                gguf_file=os.path.basename(path),
                trust_remote_code=trust_remote_code,
            )
        else:
            tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot load a tokenizer from {tokenizer_path!r}: {e}") from e
    tokenizer.padding_side = "left"
    if tokenizer.pad_token_id is None and tokenizer.eos_token_id is not None:
        # Padding is only ever masked out; the EOS token is a safe filler.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def as_token_id_set(value: int | list[int] | tuple[int, ...] | None) -> set[int]:
    """Normalise an ``eos_token_id``-style value (int, list or None) to a set of ints."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def get_generation_eos_token_ids(model_path: str) -> set[int]:
    """EOS ids listed in ``<model_path>/generation_config.json`` (empty when there is none).

    Instruct models often stop on more tokens than ``config.json`` names (e.g. an end-of-turn
    token), and only generation_config.json says so. An unreadable file is logged and ignored.
    """
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return set()
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return set()
    return as_token_id_set(data.get("eos_token_id"))
