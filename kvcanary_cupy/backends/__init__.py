"""Backends implement one interface on already-validated views.

``reference`` (NumPy, the oracle) and ``cuda`` (CuPy RawModule launches) each
provide ``plan``, ``write``, ``verify`` and ``scatter_expected_tokens`` with the
keyword arguments :mod:`kvcanary_cupy.ops` passes, plus ``fingerprints``. They
share no code but :mod:`kvcanary_cupy.format`.
"""
