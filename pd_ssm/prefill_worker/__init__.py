"""The engine in the prefill role: admit, chunked prefill, first token to the router, pages out
through a connector to the decode worker the router's ticket names (role.py)."""
