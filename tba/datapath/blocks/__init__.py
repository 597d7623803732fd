"""Blocks: which block (or pack-order window) a saved tensor belongs to, the per-block action
applied during the forward, and running a block under recompute or selective recompute."""
