"""paradigms."""
