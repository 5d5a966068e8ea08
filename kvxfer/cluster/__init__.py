"""Developer tooling: `kvxfer up` (a local cluster), a local etcd, Prometheus, the demo.

Nothing in the library or the services imports this package.
"""
