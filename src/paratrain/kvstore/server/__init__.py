"""The kvstore's server side: dense shards (server.py) and sparse tables (sparse.py) on a parameter
server."""
