"""Resolve what a path holds and read it: the parallel reader, the device ring, TP slices, sharded loads, verify."""
