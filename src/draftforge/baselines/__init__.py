"""`baselines` stage (see DESIGN.md §3)."""
