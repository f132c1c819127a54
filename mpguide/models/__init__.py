"""The reader's own model. What a reader calls: the per-module dtype and error report
(``per_module``; ``lowbit_report`` in a low-bit format), where the error comes from op by op
against a float64 shadow (``diff``) and what keeping a source in float32 buys (``fixes``),
and serving a classifier in several dtypes (``inference``).

The rooms behind them: one recorded run (``recorder``), the float64 reference compared
module call by module call (``compare``), the op-by-op shadow (``shadow``), memory checked
before a run (``memory``), progress on stderr (``progress``); and small models for pages
and tests, built from configs (``zoo``), a VAE-like decoder (``conv_decoder``) and
post-training quantization emulated on a whole model (``fake_quant``).
"""
