"""`train` stage (contracts: docs/architecture.md)."""
