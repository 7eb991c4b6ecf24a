"""The ray engine."""
