"""Environments: episodes of several turns between the policy and code that answers it.

`interfaces.py` is the contract (`Environment`: reset, step), `builtins.py`
the built-ins (`single_turn`, which makes any reward functions an
environment done after one step, and the `guess_number` game), `loader.py`
loads one by name or import path, and `serving.py` is what the environment
service does with a request (bounds, errors as a status).
"""
