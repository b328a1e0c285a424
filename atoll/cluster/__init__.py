"""Cluster tools: `atoll status` and `atoll chaos --kubernetes` against Kubernetes."""
