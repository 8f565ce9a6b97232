"""Page routers of the dashboard, one per page family."""
