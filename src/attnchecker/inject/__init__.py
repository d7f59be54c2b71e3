"""Fault injection: pure tensor edits that model hardware faults."""

from attnchecker.inject.kinds import exponent_flip, exponent_flip_bit, flip_bit

__all__ = ["exponent_flip", "exponent_flip_bit", "flip_bit"]
