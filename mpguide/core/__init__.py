"""Shared infrastructure: dtype names and the one dtype recorder (``dtypes``), tables in
every output format (``table``), global torch state and precision switches (``state``,
``switches``), device-synchronised timing (``timing``) and recordings from other machines
(``record``).
"""
