"""SBP strategy search (AutoDDL §4-§5): `python -m autotune --model gpt`."""
