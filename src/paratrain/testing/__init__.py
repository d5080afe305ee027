"""Test helpers for paratrain (multi-node harnesses and similar)."""
