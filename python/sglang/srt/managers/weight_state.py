"""What the live weights are: their label and their generation (one instance per scheduler)."""

from __future__ import annotations

from dataclasses import dataclass

from sglang.srt.managers.io_struct import DEFAULT_WEIGHT_VERSION


@dataclass
class WeightState:
    """Mutated only by the WeightUpdater; read by ReqKV (which KV may be cached) and by the
    OutputProcessor (which label each new token carries).

    ``version`` is the user-visible label (``weight_version`` on every output); ``generation``
    counts weight changes, labelled or not, so KV computed under older weights is never
    matched again whatever the labels say.
    """

    version: str = DEFAULT_WEIGHT_VERSION
    generation: int = 0
