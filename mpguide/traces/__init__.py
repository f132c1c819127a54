"""Profiler traces: profiling a callable (``profiling``), reading chrome traces into columns
(``trace``, ``columns``), call trees (``calltree``), cast reports (``casts``), a directory of
ranks (``ranks``) and synthetic traces (``tracegen``).
"""
