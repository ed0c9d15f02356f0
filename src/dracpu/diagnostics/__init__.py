"""Diagnostics of a running driver (``dracpu gatherinfo``)."""
