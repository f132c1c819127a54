"""Number formats and rounding emulation (``formats``), error statistics against a float64
reference and matmul error tables (``numerics``).
"""
