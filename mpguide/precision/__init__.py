"""Number formats and rounding emulation (``formats``), error statistics against a float64
reference and matmul error tables (``numerics``); the low-bit formats (``lowbit``), their
scaling recipes (``recipes``) and errors (``lowbit_errors``); float32 matmuls emulated by
several low-precision products (``split_matmul``); and the precision questions of serving and
training, each a module: fp8 E4M3 variants (``fp8_variants``), an fp8 KV cache
(``fp8_kv_cache``), rotary angles (``rope_angles``), a router's top-k (``router_topk``).
"""
