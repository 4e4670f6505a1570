"""`baselines` stage (contracts: docs/architecture.md)."""
