"""Prefill and decode worker services and their HTTP faces.

Each role is a service class (`prefill/service.py`, `decode/service.py`) that speaks
Python and raises typed errors, and an HTTP module (`http.py`) that parses JSON, maps those
errors to status codes and is the only place FastAPI appears besides `worker_core.py`.
"""
