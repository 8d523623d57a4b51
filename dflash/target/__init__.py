"""The target model: loading (embedded or real checkpoints) and hidden-state capture."""
