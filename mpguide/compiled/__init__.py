"""``torch.compile``: the graphs backends run and their dtype flow (``graphs``), backends
against float64 (``backends``), what the compile logs say (``compile_logs``) and what
inductor's generated code computes in (``generated_code``).
"""
