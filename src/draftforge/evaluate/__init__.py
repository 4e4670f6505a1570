"""`evaluate` stage (contracts: docs/architecture.md)."""
