"""Decisions, no I/O: the keep rule, adaptive keep, the read-ahead window, the per-block policy
and its chooser, the memory budget, when a controller decides again, and the one simulator
that adaptive keep, the chooser and `tba plan` replay steps in."""
