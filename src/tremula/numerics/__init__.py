"""Number formats the IPU computes in: FP8 (QUARTER) codes with format and scale, and saturating half casts."""
