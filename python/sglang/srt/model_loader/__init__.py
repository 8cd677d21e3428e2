"""Model loading: build a registered model class and stream safetensors / .bin / GGUF weights."""

from __future__ import annotations

from sglang.srt.model_loader.loader import get_model, iterate_weights, load_weights_into

__all__ = ["get_model", "iterate_weights", "load_weights_into"]
