"""The tunerd daemon: one asyncio loop, control server, state store, services."""
