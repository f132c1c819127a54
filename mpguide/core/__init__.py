"""Shared infrastructure: dtype names and the one dtype recorder (``dtypes``; what counts as
a cast, without torch, in ``cast_rule``), tables in every output format (``table``), global
torch state and precision switches (``state``, ``switches``), devices, live or simulated on
fake tensors under another device's autocast (``device``), device-synchronised timing
(``timing``), recordings from other machines (``record``), the torch releases facts hold for
(``versions``), results kept between processes (``stored``), this CPU's bf16 units and speed
(``cpu_bf16``), and the command line's output and the reader's code it runs (``output``,
``readers_code``, ``terminal``, ``units``, ``quiet``).
"""
