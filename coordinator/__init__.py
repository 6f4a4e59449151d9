"""The cluster brain: failure detection, spare promotion, epochs and membership kept in etcd."""
