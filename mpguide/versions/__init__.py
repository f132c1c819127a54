"""The facts that change between torch releases, recorded and compared: the probes that record
them on the running torch (``probes``: ``python -m mpguide.versions.probes --out DIR``) and the
comparison of recordings, release by release (``diffs``). It sits above the chapters it
probes (the autocast policy among them); the window and the dated facts pages read stay in
:mod:`mpguide.core.versions`.
"""
