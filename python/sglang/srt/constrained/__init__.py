"""Constrained decoding: grammars that mask a request's logits (docs/constrained_decoding.md)."""
