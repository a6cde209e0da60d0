"""Drafters: propose tries under the root and learn from verify; they can never change the output, only its speed."""
