"""grabkit.group."""
