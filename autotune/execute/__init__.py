"""Execute SBP plans on a real PyTorch model (DTensor placements), check them against one process, time them."""
