"""`report` stage (see DESIGN.md §3)."""
