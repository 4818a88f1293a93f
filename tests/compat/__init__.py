"""Runs the tests shipped in torchft's wheel against torchft_lite (``make compat``).

Nothing here is collected by this project's own pytest run (see ``conftest.py``).
"""
