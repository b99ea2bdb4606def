"""Trained parts that plug into a target model: exit heads (and, later, draft heads), saved as Hub-style folders
fingerprinted to their target."""
