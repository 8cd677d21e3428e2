"""Architecture name (``config.architectures``) -> model class, from each model file's
``EntryClass``. Model modules are imported on the first lookup, not at package import."""

from __future__ import annotations

import importlib
import logging
import pkgutil

import sglang.srt.models as models_pkg

logger = logging.getLogger(__name__)

_NOT_MODEL_MODULES = {"registry"}
_registry: dict[str, type] | None = None


def _load_registry() -> dict[str, type]:
    """Import every model module once and index its EntryClass by class name."""
    global _registry
    if _registry is None:
        found: dict[str, type] = {}
        for info in pkgutil.iter_modules(models_pkg.__path__):
            if info.name in _NOT_MODEL_MODULES:
                continue
            try:
                module = importlib.import_module(f"{models_pkg.__name__}.{info.name}")
            except ImportError as exc:  # an optional dependency of one model must not hide all
                logger.warning("Skipping model module %s: %s", info.name, exc)
                continue
            entry = getattr(module, "EntryClass", None)
            entries = entry if isinstance(entry, list | tuple) else [entry] if entry else []
            for cls in entries:
                found[cls.__name__] = cls
        _registry = found
    return _registry


def get_supported_architectures() -> list[str]:
    """Sorted names of every architecture a model file registers."""
    return sorted(_load_registry())


def get_model_class(architectures: list[str]) -> type:
    """The class of the first supported name in ``architectures`` (HF config order).

    Raises ValueError naming the requested architectures and listing the supported ones.
    """
    registry = _load_registry()
    for arch in architectures or []:
        if arch in registry:
            return registry[arch]
    raise ValueError(
        f"model architecture(s) {list(architectures or [])} not supported; "
        f"supported: {sorted(registry)}"
    )
