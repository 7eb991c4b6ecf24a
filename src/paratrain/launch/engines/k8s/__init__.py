"""The k8s engine."""
