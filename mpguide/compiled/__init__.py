"""``torch.compile``: the graphs backends run and their dtype flow (``graphs``), backends
against float64 (``backends``) and what the compile logs say (``compile_logs``).
"""
