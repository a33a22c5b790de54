"""Data models shared by every layer: recipes, selections, plans, bench figures, deployment records."""
