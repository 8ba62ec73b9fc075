"""Stage 1 of the flow: time the collectives and fit their alpha-beta models."""
