"""The emulated runner (`--runner emulated`, a benchmark and test tool): `runner.py` keeps `ModelRunner`'s
interface with the forward pass replaced by a wait, `tokens.py` is its weightless "model" whose logits are a
pure function of the sequence.
"""
