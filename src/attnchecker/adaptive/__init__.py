"""Adaptive protection: choose what to check from the fault rate, the model's vulnerability and
the cost of each check (:mod:`.profile`, :mod:`.bench`, :mod:`.controller`, :mod:`.simulate`)."""
