"""Making model files: the synthetic test pair, tokenizers, the bundled models, draft training."""
