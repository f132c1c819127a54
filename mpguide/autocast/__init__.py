"""Devices, live or simulated on fake tensors under another device's autocast (``device``),
autocast's per-op dtype policy on each (``policy``) over every op this torch registers an
autocast kernel for (``catalogue``), and what ``torch.autocast`` itself accepts (``accepts``).
"""
