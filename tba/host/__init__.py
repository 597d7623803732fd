"""Host memory: aligned (and pinned) buffers that direct I/O can use without a copy, a pool of
mappings, the malloc the process runs on, and what memory the host can spare."""
