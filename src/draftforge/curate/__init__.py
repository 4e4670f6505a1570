"""`curate` stage (contracts: docs/architecture.md)."""
