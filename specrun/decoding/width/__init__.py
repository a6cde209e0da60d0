"""The width tuner: how many trie nodes a step verifies, for speed only (any width gives the same tokens)."""
