"""dispatch-coordinator: schedule scanner, aging, budgeted dispatch by lane, auto slow-down (§9, §12.4)."""
