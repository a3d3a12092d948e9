"""Warnings and refusals about the user's own code, installed at registration.

An optimizer whose decay rule cannot see inside a flat parameter, one that is not element-wise over
flat parameters, one that steps leaves of per-tensor mode in flat mode, memory stepped by two
optimizers (``decay_check.py``, ``step_checks.py``: a global optimizer step pre-hook installed with
the first registration); a submodule asked for parameters that are slices (``submodule_walks.py``:
methods of the injected classes); parameters added after registration that the flat features leave
out (``left_out.py``). This wing imports the core only; the install imports it.
"""
