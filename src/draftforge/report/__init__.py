"""`report` stage (contracts: docs/architecture.md)."""
