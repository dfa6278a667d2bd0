"""The engine in the decode role: reserve on request, receive and import pages, decode in the
running batch, stream tokens to the router (role.py)."""
