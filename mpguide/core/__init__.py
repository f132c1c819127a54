"""Shared infrastructure: dtype names and the one dtype recorder (``dtypes``), tables in
every output format (``table``), global torch state and precision switches (``state``,
``switches``), devices, live or simulated on fake tensors under another device's autocast
(``device``), device-synchronised timing (``timing``), recordings from other machines
(``record``), the torch releases facts hold for (``versions``), and the command line's output
and the reader's code it runs (``output``, ``readers_code``).
"""
