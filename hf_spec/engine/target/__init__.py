"""What the engine knows about the target model, in one place: its profile (computed once per model), placement
and kernel eligibility, attention windows, KV-cache operations (crop, compact), LLM.int8 rows, the verification
forward's inputs, and the one-time check that the model verifies trees correctly."""
