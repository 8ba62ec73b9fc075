"""Stage 2 of the flow: plans from fitted profiles (SBP search, collective
schedules, cross-mesh resharding)."""
