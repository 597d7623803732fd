"""Records: entries and their states, handles with their version witness, the dedup index,
per-step counters and the reasons a tensor was kept. Plain data and the rules that keep it
consistent; nothing here calls up into the parts that own it."""
