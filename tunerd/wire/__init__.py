"""The control socket's protocol and the client every tunerctl command talks through."""
