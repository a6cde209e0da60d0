"""Verification: sampling, penalty, stop rules, the trie and the sequence: AR's exact token at every trie node (I1)."""
