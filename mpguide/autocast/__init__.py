"""Autocast's per-op dtype policy on each device (``policy``, built from the calls in
``calls`` and the probes in ``probing``, run on a real device in a child process by
``isolated``) over every op this torch registers an autocast kernel for (``catalogue``), and
what ``torch.autocast`` itself accepts (``accepts``).
"""
