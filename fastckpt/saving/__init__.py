"""The save engine: collect -> plan -> stage -> write -> commit, for one rank or many."""
