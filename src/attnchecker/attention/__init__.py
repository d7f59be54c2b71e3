"""Model-agnostic protected attention: config, checks, the checked core, per-module state."""

from attnchecker.attention.config import OPS, ABFTConfig
from attnchecker.attention.core import CoreSpec, attend
from attnchecker.attention.state import AttentionState, SiteCall, SiteHook

__all__ = ["OPS", "ABFTConfig", "AttentionState", "CoreSpec", "SiteCall", "SiteHook", "attend"]
