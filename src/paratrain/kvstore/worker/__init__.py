"""The kvstore's worker side: the stores a training script talks to (dist, host, local) and the
sparse tables' client. They implement api.KVStore."""
