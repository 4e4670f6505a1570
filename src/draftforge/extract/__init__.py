"""`extract` stage (contracts: docs/architecture.md)."""
