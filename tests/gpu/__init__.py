# A package, so that pytest imports this folder's conftest.py as gpu.conftest and not as a second top-level
# "conftest" that would shadow tests/python's (its tests import helpers from it) in one pytest run.
