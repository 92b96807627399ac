"""The entry points' command line: flag groups (`flags`) and their validation (`validate`).

The top layer of the package (docs/ARCHITECTURE.md, "Layers"): it may import every other
dschat layer, and nothing in dschat imports it.
"""
