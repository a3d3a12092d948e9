"""Every wrapper of someone else's code (DCP, FSDP, Lightning, timm, torchao, torch's own renames and
swaps), and the one table that lists them (``registry.py``, which ``docs/outside-code.md`` shows).

Only the package's front door (``flatten_parametrize/__init__.py``) imports this wing; it imports the
others (the core, the install, the features, the distributed wing), never the reverse.
"""
