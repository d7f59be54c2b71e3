"""Fault injection: pure tensor edits that model hardware faults (more arrives with the injector)."""

from attnchecker.inject.kinds import exponent_flip, exponent_flip_bit, flip_bit

__all__ = ["exponent_flip", "exponent_flip_bit", "flip_bit"]
