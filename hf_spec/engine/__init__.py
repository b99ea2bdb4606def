"""The round engine: one loop for every path (a sequence, a batch in one forward, rows one by one), its kernel
backends and the target profile they are chosen from. See `hf_spec.engine.round` for the round's steps."""
