"""Inspection for notebooks: ``repr``, ``summary()``, the HTML table and ``plot_layout()``.

Reads the coordinator through ``_core``'s records only.
"""
