"""grabkit.accumulate."""
