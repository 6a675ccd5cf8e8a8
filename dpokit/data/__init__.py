"""Training data as files: the pair, example and SFT formats (formats), supervised rows (supervised), tokenisation (tokenization) and its on-disk cache (token_cache), run logs (runlogs)."""
