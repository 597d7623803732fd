"""The host: aligned (and pinned) buffers that direct I/O can use without a copy, a pool of
mappings, the malloc the process runs on, what memory the host can spare, and the one clock
the core measures time with."""
