"""The graph hocompile works on: its conventions and printer (``graph.py``), the op-family registry,
decisions passes record, the dtype vocabulary, graphs as plain data (``codec.py``) and the graph
patterns the Newton–Schulz recogniser matches (``matrix_polynomial.py``, ``ns_normalization.py``).
"""
