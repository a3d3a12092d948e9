"""State dicts and optimizer state: both forms, atomic loading, aliases for savers.

Uses ``_core`` only; the injected classes of ``_install`` call into it.
"""
