"""Devices, live or simulated on fake tensors under another device's autocast (``device``),
and autocast's per-op dtype policy on each (``policy``).
"""
