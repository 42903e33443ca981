"""How bytes move and become visible: I/O backends, host memory and staging pools, the root lock, atomic commit."""
