"""The reader's own model: the per-module dtype and error report (``per_module``) and serving
a classifier in several dtypes (``inference``).
"""
