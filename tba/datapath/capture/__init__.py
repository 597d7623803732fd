"""Capture: a saved tensor's bytes taken off the training thread's hands. Staging blocks and
the pool, coalesced batches of small tensors, the device adapters (the only place with CUDA
streams and events), tensors rebuilt from a parameter instead of written, DTensor shards."""
