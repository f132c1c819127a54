"""Profiler traces. What a reader calls: profiling a callable (``profiling``), reading a
chrome trace (``trace.load``), its call trees (``calltree``), the cast report (``casts``), a
directory of ranks (``ranks``), synthetic traces (``tracegen``) and what casts cost on a
device (``cast_cost``).

The rooms behind them: the columns a trace is read into (``columns``), the memory a read
takes (``memory``), a large file read in two processes (``halves``), how events nest and
GPU events link to their launches (``nesting``, ``gpu_links``), what a cast is in a trace
(``cast_kinds``), the report's tables and their text at the terminal's width
(``cast_tables``, ``cast_text``, ``rank_text``).
"""
