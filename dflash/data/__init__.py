"""Data: prepared datasets (sources, synthetic) and token-budget batching."""
