"""The local engine."""
