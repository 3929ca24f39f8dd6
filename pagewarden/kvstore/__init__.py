"""KV store tiers outside the device pool: a disk directory and a Redis server.

A block leaves the pool when it is evicted from the prefix cache and comes back on a
later prefix hit; nothing from a tier reaches attention unverified (``format.py`` says
what an entry carries and what a load checks). The format and key code imports no torch.
"""
