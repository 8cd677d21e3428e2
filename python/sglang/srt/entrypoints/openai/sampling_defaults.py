"""Default sampling parameters of /v1/chat/completions: the model's recommendation, then OpenAI's.

Upstream SGLang's ``--sampling-defaults model`` (its default) reads ``temperature``, ``top_p``,
``top_k``, ``min_p`` and ``repetition_penalty`` from the model's ``generation_config.json`` and
uses them for a chat request that leaves the field out or sends ``null``;
``--sampling-defaults openai`` uses OpenAI's values only. /v1/completions and the native
/generate always use OpenAI's (SGLang's) defaults, as upstream.
"""

from __future__ import annotations

import json
import logging
import math
import os
from typing import Any

logger = logging.getLogger(__name__)

# OpenAI's (and SGLang's) defaults of the fields a model's generation config may override.
OPENAI_SAMPLING_DEFAULTS: dict[str, float | int] = {
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
}


def load_model_sampling_defaults(model_path: str, mode: str = "model") -> dict[str, float | int]:
    """The sampling defaults ``<model_path>/generation_config.json`` recommends.

    Returns only the fields of :data:`OPENAI_SAMPLING_DEFAULTS` the file sets to a number
    (``top_k`` an int); empty when ``mode`` is not ``"model"``, when ``model_path`` is not a
    directory (a ``.gguf`` file) or has no such file. An unreadable file, or a field of the wrong
    type, is logged and ignored: the server still starts, with OpenAI's default for it.
    """
    if mode != "model":
        return {}
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        logger.warning("ignoring unreadable %s: %s", path, e)
        return {}
    if not isinstance(config, dict):
        logger.warning("ignoring %s: not a JSON object", path)
        return {}
    defaults: dict[str, float | int] = {}
    for name in OPENAI_SAMPLING_DEFAULTS:
        value = _number(config.get(name), integer=name == "top_k")
        if value is not None:
            defaults[name] = value
        elif config.get(name) is not None:
            logger.warning("ignoring %s=%r in %s: not a number", name, config[name], path)
    if defaults:
        logger.info("Chat sampling defaults from the model's generation config: %s", defaults)
    return defaults


def _number(value: Any, integer: bool) -> float | int | None:
    """``value`` as a finite float (an int when ``integer``), or None when it is not one."""
    # bool is an int subclass; true/false in the file is not a sampling value.
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    if not math.isfinite(value):
        return None
    if integer:
        return int(value) if float(value).is_integer() else None
    return float(value)


def resolve_sampling_defaults(params: dict[str, Any], model_defaults: dict[str, Any]) -> None:
    """Replace, in place, each field of :data:`OPENAI_SAMPLING_DEFAULTS` that ``params`` leaves
    None (absent or ``null`` in the request) by ``model_defaults``' value, else OpenAI's."""
    for name, openai_default in OPENAI_SAMPLING_DEFAULTS.items():
        if params.get(name) is None:
            params[name] = model_defaults.get(name, openai_default)
