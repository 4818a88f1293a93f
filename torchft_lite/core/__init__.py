"""The Manager's internals: its settings and wiring, one step's quorum, heal and commit, and who hears of it.

:mod:`torchft_lite.manager` is the API; nothing here is imported by training scripts.
"""
