"""The cluster: membership sources (static, etcd), weighted rendezvous placement with replicas
on distinct nodes and zones, the replicated :class:`ClusterClient`, and a daemon's etcd
registration. Nothing heavy is imported here."""
