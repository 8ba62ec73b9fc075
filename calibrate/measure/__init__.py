"""One measurement engine and one set of statistics for every A/B of the project.

``engine``: arms interleaved in rounds, checked before and after the timed calls;
``stats``: median and its interval, geomean, Spearman and Kendall, the one relative
error; ``verdict``: targets that say "unknown" rather than omit; ``heldout``: the sizes a
tuner may not look at, declared and hashed before development.
"""
