"""paratrain's version: here, at the bottom of the layers, so that the scheduler and the nodes that
register with it compare versions without importing the package root."""

__version__ = "0.1.0"
