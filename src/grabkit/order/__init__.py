"""grabkit.order."""
