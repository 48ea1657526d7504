"""ksim: a dynamic kernel instrumentation engine and testbed."""

__version__ = "0.1.0"
