"""The model forward: tokens at explicit positions and masks through a KV store (solo or paged); knows nothing of
drafting or sampling."""
